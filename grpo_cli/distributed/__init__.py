"""Several processes as one run: the rank's view of the process group and its collectives (`parallel`), and
the launcher that starts the ranks through torch's elastic agent (`launch`)."""
