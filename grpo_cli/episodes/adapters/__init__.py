"""Other libraries' environment classes as our environments: TRL's environment_factory
(trl.py) and OpenRLHF's agent class (openrlhf.py); SkyRL-gym's adapter is episodes/environments.py's."""
