"""Importing the user's own functions for task=custom: `path/to/file.py:function` or `package.module:function`.

A file path is read as a file (relative paths from `base_dir`, the directory grpo-run was started from); anything
else is a dotted module, imported with `base_dir` first on sys.path, so a `rewards/` package beside the user's
config works as it would in their own scripts. A reward may also be a Hydra node, `{_target_: <factory or class>,
<its arguments>}`, instantiated once per process (`load_reward_spec`). Every failure is one UserFacingError line
naming the config key (`task.rewards.fmt=...`), the file or module, and what to write instead. No torch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from grpo_cli.errors import UserFacingError

# The key of a Hydra node that names the callable to instantiate (hydra.utils.instantiate).
TARGET_KEY = "_target_"


class UserCodeError(UserFacingError):
    """The user's file, module or function cannot be found, imported or called the way its key says."""


def is_file_reference(target: str) -> bool:
    """`rewards.py`, `./lib/rewards.py`, `/abs/rewards.py`: a file; `mypkg.rewards`: a module."""
    return target.endswith(".py") or "/" in target or "\\" in target


def split_reference(key: str, reference: str) -> tuple[str, str]:
    """'rewards.py:format_reward' -> ('rewards.py', 'format_reward'); one line when the form is wrong."""
    target, sep, name = str(reference).rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise UserCodeError(
            f"{key}={reference}: give a function as path/to/file.py:function or package.module:function"
        )
    return target, name


def resolve_file(target: str, base_dir: Path) -> Path:
    """A file reference as an absolute path, relative ones against `base_dir`."""
    path = Path(target).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()


def absolute_reference(reference: str, base_dir: Path) -> str:
    """A file reference made absolute (every process, rank and actor then finds the same file); a module
    reference as it is (found from task.base_dir)."""
    target, sep, name = str(reference).rpartition(":")
    if sep and target and is_file_reference(target):
        return f"{resolve_file(target, base_dir)}:{name}"
    return str(reference)


def _first_line_of(error: BaseException) -> str:
    """`SyntaxError at rewards.py:3: invalid syntax`, or the error and the user's innermost frame."""
    if isinstance(error, SyntaxError):
        return f"SyntaxError at {Path(error.filename or '?').name}:{error.lineno}: {error.msg}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "importlib" not in f.filename]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    message = " ".join(str(error).split())[:200]
    return f"{type(error).__name__}: {message}{where}"


def _import_file(key: str, path: Path) -> ModuleType:
    if not path.is_file():
        raise UserCodeError(f"{key}: no such file {path}: give a .py file (relative to where you ran grpo-run)")
    # One module per file, named by its path: importing the same file twice (validation, then each worker)
    # reuses it, and two rewards.py files in different folders stay apart.
    module_name = "grpo_user_code_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{key}: {path} cannot be imported as Python: give a .py file")
    module = importlib.util.module_from_spec(spec)
    # The file's own folder first, so it can import its helper modules as it would when run as a script.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - any failure of the user's file at import time is one line
        del sys.modules[module_name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise UserCodeError(f"{key}: importing {path} failed: {_first_line_of(e)}") from None
    return module


def _import_module(key: str, dotted: str, base_dir: Path) -> ModuleType:
    if str(base_dir) not in sys.path:
        sys.path.insert(0, str(base_dir))
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as e:
        if e.name and dotted.startswith(e.name):
            raise UserCodeError(
                f"{key}: no module named {e.name} (looked in {base_dir} and the installed packages): "
                "give path/to/file.py:function or an importable package.module:function"
            ) from None
        raise UserCodeError(f"{key}: importing {dotted} failed: {_first_line_of(e)}") from None
    except BaseException as e:  # noqa: BLE001 - the user's module failing at import time is one line
        if isinstance(e, KeyboardInterrupt):
            raise
        raise UserCodeError(f"{key}: importing {dotted} failed: {_first_line_of(e)}") from None


def load_callable(
    key: str, reference: str, base_dir: Path, what: Literal["function", "class"] = "function", shown: str | None = None
) -> Callable[..., Any]:
    """The function (or class: `what`) `reference` names (`file.py:function` or `package.module:function`); `key`
    is the config key that gave it, and `shown` the reference as the user wrote it (a dotted `_target_`), for the
    error line."""
    target, name = split_reference(key, reference)
    given = f"{key}={shown or reference}"
    if is_file_reference(target):
        module = _import_file(given, resolve_file(target, base_dir))
    else:
        module = _import_module(given, target, base_dir)
    fn = getattr(module, name, None)
    if fn is None:
        kind = inspect.isclass if what == "class" else inspect.isfunction
        # What the module itself defines of that kind (not what it imported).
        defined = sorted(
            n
            for n, v in vars(module).items()
            if kind(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        hint = f" (it defines {', '.join(defined)})" if defined else ""
        raise UserCodeError(f"{given}: {target} has no {what} {name}{hint}")
    if not callable(fn):
        raise UserCodeError(f"{given}: {name} in {target} is a {type(fn).__name__}, not a {what}")
    return fn


def check_signature(key: str, reference: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """UserCodeError when `fn` cannot be called with these arguments (a wrong signature), naming how it will be
    called and the signature it has."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function without a signature: found out when it is called
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        called = ", ".join([*("..." for _ in args), *(f"{k}=..." for k in kwargs)])
        raise UserCodeError(
            f"{key}={reference}: {getattr(fn, '__name__', 'the function')}{signature} cannot be called as "
            f"({called}): {e}"
        ) from None


def keyword_names(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The keyword arguments `fn` names, or None when it takes any (**kwargs, or no signature to read): what a
    caller filters its keyword arguments by (a reward's, an agent's)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return tuple(p.name for p in parameters)


def accepted_keywords(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` less what `fn` does not take (all of them when it takes any)."""
    names = keyword_names(fn)
    return kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}


def file_sha256(reference: str, base_dir: Path) -> tuple[str, str] | None:
    """(the file, the sha256 of its bytes) of a file reference, or of a module's source file; None when there is
    none to read (a module without a file)."""
    target, _, _ = str(reference).rpartition(":")
    if is_file_reference(target):
        path = resolve_file(target, base_dir)
    else:
        try:
            if str(base_dir) not in sys.path:
                sys.path.insert(0, str(base_dir))
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            return None
        path = Path(spec.origin)
    try:
        return str(path), hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


# ------------------------------------------------------------------------------------- reward specs (task.rewards)

# What task.rewards.<name> holds: a reference string, or a plain dict with "_target_" (a Hydra node). Both
# pickle, so a worker process can load the same reward from the same spec.
RewardSpec = str | dict[str, Any]


def named_specs(values: Any, key: str) -> dict[str, RewardSpec]:
    """A `{name: reference}` config mapping (task.rewards, task.tools) as plain data: each value a reference string
    (`file.py:fn`, `package.module:fn`) or a `_target_` node; a UserCodeError naming `key.<name>` for anything else."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(values):
        values = OmegaConf.to_container(values, resolve=True)
    specs: dict[str, RewardSpec] = {}
    for name, value in (values or {}).items():
        if isinstance(value, dict):
            specs[str(name)] = {str(k): v for k, v in value.items()}
        elif isinstance(value, str) and value:
            specs[str(name)] = value
        else:
            raise UserCodeError(
                f"{key}.{name}={value!r}: give path/to/file.py:function, package.module:function or a node "
                "{_target_: package.module.factory, <its arguments>}"
            )
    return specs


def spec_text(spec: RewardSpec) -> str:
    """How a spec reads in an error line: the string, or the node in Hydra's override syntax."""
    if isinstance(spec, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in spec.items()) + "}"
    return str(spec)


def spec_reference(spec: RewardSpec) -> str | None:
    """The `file.py:function` / `package.module:function` a spec names (a node's _target_, dotted `pkg.mod.fn`
    read as `pkg.mod:fn`), for making paths absolute and hashing the file; None when it names none."""
    target = spec.get(TARGET_KEY) if isinstance(spec, dict) else spec
    if not isinstance(target, str) or not target:
        return None
    reference = _as_reference(target)
    return reference if ":" in reference else None


def with_absolute_reference(spec: RewardSpec, base_dir: Path) -> RewardSpec:
    """The spec with a file reference (its own, or its node's `_target_: file.py:factory`) made absolute."""
    if isinstance(spec, dict):
        target = spec.get(TARGET_KEY)
        if isinstance(target, str) and ":" in target:
            return {**spec, TARGET_KEY: absolute_reference(target, base_dir)}
        return dict(spec)
    return absolute_reference(str(spec), base_dir)


def load_reward_spec(key: str, spec: RewardSpec, base_dir: Path) -> Callable[..., Any]:
    """The callable a task.rewards spec gives: the function a reference string names (`pkg.mod.fn` reads as
    `pkg.mod:fn`), or what a node's
    `_target_` returns when called with the node's arguments (hydra.utils.instantiate: a factory's reward function,
    an instance of a class with __call__, or with `_partial_: true` the target itself with those arguments bound).
    `_target_` is a dotted path (`trl.rewards.get_soft_overlong_punishment`, found from `base_dir` too) or a
    reference (`factories.py:make_reward`). Loaded once per process and spec (a factory's reward keeps its state
    across batches, as it does in TRL); `key` (task.rewards.<name>) is for the error line."""
    if isinstance(spec, dict):
        return _instantiated(key, _frozen(spec), str(base_dir))
    reference = str(spec)
    return load_callable(key, reference if is_file_reference(reference) else _as_reference(reference), base_dir)


def _frozen(value: Any) -> Any:
    """A hashable copy of a plain dict/list tree (the cache key of an instantiated spec)."""
    if isinstance(value, dict):
        return ("__dict__", tuple((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("__list__", tuple(_frozen(v) for v in value))
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__dict__":
        return {k: _thawed(v) for k, v in value[1]}
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__list__":
        return [_thawed(v) for v in value[1]]
    return value


@functools.cache
def _instantiated(key: str, frozen_spec: Any, base_dir: str) -> Callable[..., Any]:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    spec = _thawed(frozen_spec)
    target = spec.get(TARGET_KEY)
    shown = f"{key}={spec_text(spec)}"
    if not isinstance(target, str) or not target:
        raise UserCodeError(
            f"{shown}: a reward (or tool) given as a node names what to call in _target_: "
            "{_target_: package.module.factory, <its arguments>} (or a file.py:function string)"
        )
    # Resolved the way a reward string is (base_dir on sys.path, one-line errors), then handed to Hydra as the
    # callable itself.
    spec = {
        **spec,
        TARGET_KEY: load_callable(f"{key}.{TARGET_KEY}", _as_reference(target), Path(base_dir), shown=target),
    }
    spec.setdefault("_convert_", "all")  # plain lists and dicts reach the factory, not OmegaConf containers
    if spec.get("_partial_") is True:  # Hydra binds nothing yet: an argument the target does not take is said now
        _check_partial_arguments(shown, target, spec)
    try:
        made = instantiate(spec)
    except InstantiationException as e:
        cause = e.__cause__ or e
        detail = " ".join(str(cause).split())[:240]
        raise UserCodeError(f"{shown}: calling {target} failed: {type(cause).__name__}: {detail}") from None
    except Exception as e:  # noqa: BLE001 - the user's factory failing is one line
        raise UserCodeError(f"{shown}: calling {target} failed: {_first_line_of(e)}") from None
    if not callable(made):
        raise UserCodeError(
            f"{shown}: {target}(...) returned a {type(made).__name__}, not a function: name a factory that returns "
            "the function (the reward or the tool), a class with __call__, or a function with _partial_: true"
        )
    return made


def _check_partial_arguments(shown: str, target: str, spec: dict[str, Any]) -> None:
    """A `_partial_: true` node's arguments against its target's signature (UserCodeError naming the argument the
    target does not take): Hydra binds them only when the reward is called, where the error names neither the
    key nor the argument ("partial object ... has incorrect arguments")."""
    function = spec[TARGET_KEY]
    arguments = {k: v for k, v in spec.items() if not (k.startswith("_") and k.endswith("_"))}
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    try:
        signature.bind_partial(*spec.get("_args_", []), **arguments)
    except TypeError as e:
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        unknown = [name for name in arguments if name not in signature.parameters and not takes_any]
        what = f"takes no argument {unknown[0]}=" if unknown else f"cannot take these arguments ({e})"
        name = getattr(function, "__name__", target)
        raise UserCodeError(
            f"{shown}: {name}{signature} {what}: give only its own parameters in the node (with _partial_: true "
            "they are bound now, the rest passed at each call)"
        ) from None


def _as_reference(target: str) -> str:
    """A _target_ as a reference: `file.py:f` and `pkg.mod:f` as they are, dotted `pkg.mod.f` as `pkg.mod:f`."""
    if ":" in target:
        return target
    module, dot, name = target.rpartition(".")
    return f"{module}:{name}" if dot and module else target
