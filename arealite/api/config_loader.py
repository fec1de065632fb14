"""Loading configs: `--config FILE.yaml` plus dotted `key=value` overrides, validated.

Kept apart from the dataclasses in `cli_args.py` (which imports this module and re-exports
`load_expr_config` and `to_yaml`; this module never imports it): this module is about error
messages that name the key, the value and the closest valid key (or the allowed values of a
`Literal`-typed choice), not about what the options are.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import typing
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from arealite.api.presets import ACTOR_PRESETS, ROLLOUT_PRESETS


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


def literal_choices(hint: Any) -> tuple | None:
    """The allowed values of a `Literal[...]` or `Optional[Literal[...]]` type, else None."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    for arg in typing.get_args(hint):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return None


def choice_error(key: str, value: Any, allowed: tuple) -> ConfigError:
    return ConfigError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")


def help_text(text: str) -> dict:
    """`field(metadata=help_text(...))`: the help of a config field."""
    return {"help": text}


def require(ok: bool, key: str, value: Any, rule: str) -> None:
    """A value check of `__post_init__`: ConfigError `<key> must be <rule>, got <value>` unless
    `ok`, e.g. `require(self.rank >= 1, "lora.rank", self.rank, ">= 1")`."""
    if not ok:
        raise ConfigError(f"{key} must be {rule}, got {value}")


def derived_from(source: str, text: str) -> dict:
    """`field(metadata=derived_from("gconfig.n_samples", ...))`: a field that the experiment
    config sets from the user's key `source` in its `__post_init__` (one key per fact). It is
    no key of the YAML or the command line (setting it is a ConfigError naming `source`), and
    `to_yaml` leaves it out, so a written config loads again."""
    return {"help": f"{text} Derived: set from {source}.", "derived_from": source}


# Keys that were the user's once and are no more: key -> what to set instead.
RENAMED_KEYS: dict[str, str] = {
    "async_training": "rollout.max_head_offpolicyness (0 = synchronous RL, > 0 = asynchronous "
    "with that staleness bound)",
    "rollout.reward_fail_fast_calls": "rollout.reward_fail_fast_steps (the run stops after that "
    "many steps in a row in which every reward call failed; 0 = off)",
    "actor.dynamic_sampling_max_oversample": "rollout.dynamic_sampling_max_oversample",
    "actor.dynamic_sampling_skip_max_prob": "rollout.dynamic_sampling_skip_max_prob",
}


@dataclasses.dataclass
class ConfigBase:
    """Base of every config dataclass: its `Literal[...]` fields are its choices, and the allowed
    values show in the type, in the loader's errors and in errors of configs built in Python."""

    def __post_init__(self):
        check_choices(self)


def check_choices(config: Any) -> None:
    """Every `Literal`-typed field of the dataclass `config` holds an allowed value. The loader
    has checked them already (naming the full dotted key); this catches configs built in
    Python, naming `ClassName.field`."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        allowed = literal_choices(hints[f.name])
        value = getattr(config, f.name)
        if allowed is not None and value not in allowed:
            if value is None and type(None) in typing.get_args(hints[f.name]):
                continue
            raise choice_error(f"{type(config).__name__}.{f.name}", value, allowed)


def _derived_keys(cls: type, prefix: str = "") -> dict[str, str]:
    """Dotted key -> its source key, of every `derived_from` field of a config dataclass."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        key, sub = f"{prefix}{f.name}", _dataclass_in(hints[f.name])
        if "derived_from" in f.metadata:
            out[key] = f.metadata["derived_from"]
        elif sub is not None:
            out.update(_derived_keys(sub, key + "."))
    return out


def _valid_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, including keys inside Optional sub-configs
    (not the derived ones)."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or "derived_from" in f.metadata:
            continue
        key = f"{prefix}{f.name}"
        keys.append(key)
        sub = _dataclass_in(hints[f.name])
        if sub is not None:
            keys.extend(_valid_keys(sub, key + "."))
    return keys


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass in `hint` (`X` or `Optional[X]`), if any."""
    for t in (hint, *typing.get_args(hint)):
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            return t
    return None


def _suggest(bad_key: str, valid: list[str]) -> str | None:
    """Closest valid key: same top-level section first, then by leaf-name similarity."""
    head, _, _ = bad_key.partition(".")
    leaf = bad_key.rsplit(".", 1)[-1]

    def score(k: str) -> float:
        same_head = k.partition(".")[0] == head if "." in bad_key else 1.0
        leaf_ratio = difflib.SequenceMatcher(None, leaf, k.rsplit(".", 1)[-1]).ratio()
        full_ratio = difflib.SequenceMatcher(None, bad_key, k).ratio()
        return 0.5 * same_head + leaf_ratio + 0.3 * full_ratio

    best = max(valid, key=score, default=None)
    if best is None or score(best) < 0.9:
        return None
    return best


def _flatten(d: Any, prefix: str = "") -> list[str]:
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}{k}"
            out.append(key)
            out.extend(_flatten(v, key + "."))
    return out


def _free_form_keys(cls: type, prefix: str = "") -> list[str]:
    """Keys of dict / Any fields (dataset `options`, `columns`): their sub-keys are the user's."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        sub = _dataclass_in(hint)
        if sub is not None:
            out.extend(_free_form_keys(sub, key + "."))
        elif hint is Any or typing.get_origin(hint) is dict or hint is dict:
            out.append(key)
    return out


def _check_keys(user_keys: list[str], config_cls: type, source: str) -> None:
    valid = _valid_keys(config_cls)
    valid_set = set(valid)
    free = tuple(k + "." for k in _free_form_keys(config_cls))
    renamed = {**RENAMED_KEYS, **_derived_keys(config_cls)}
    for key in user_keys:
        if key in renamed:
            raise ConfigError(
                f"Config key {key!r} (from {source}) is no longer set by the user: set "
                f"{renamed[key]} instead"
            )
        if key not in valid_set and not key.startswith(free):
            hint = _suggest(key, valid)
            msg = f"Unknown config key {key!r} (from {source})"
            if hint:
                msg += f"; did you mean {hint!r}?"
            raise ConfigError(msg)


def _apply_presets(merged: Any, user_cfg: Any) -> Any:
    """Put actor presets *under* the user's values, so explicit keys still win (the preset's
    name has been checked against its Literal type by the merge with the schema)."""
    preset = OmegaConf.select(user_cfg, "actor.preset", default=None)
    if preset is None:
        return merged
    layer = {"actor": ACTOR_PRESETS[preset]}
    if preset in ROLLOUT_PRESETS and "rollout" in merged:
        layer["rollout"] = ROLLOUT_PRESETS[preset]
    return OmegaConf.merge(merged, layer, user_cfg)


def load_expr_config(argv: list[str], config_cls: type) -> Any:
    """Parse `--config FILE.yaml key=value ...` into a validated `config_cls` instance.

    Raises ConfigError naming the key for unknown keys (with the closest valid key), wrong
    types (key, value, expected type), a missing config file, and failed validation.
    """
    help_section = _help_request(argv)
    if help_section is not None:
        print(config_help(config_cls, help_section or None))
        raise SystemExit(0)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", help="YAML config file")
    args, overrides = parser.parse_known_args(argv)
    for o in overrides:
        if "=" not in o or o.startswith("-"):
            raise ConfigError(
                f"Bad override {o!r}: expected dotted key=value, e.g. actor.optimizer.lr=1e-5"
            )

    layers = []
    if args.config:
        if not os.path.isfile(args.config):
            raise ConfigError(f"Config file not found: {args.config}")
        file_cfg = OmegaConf.load(args.config)
        _check_keys(_flatten(OmegaConf.to_container(file_cfg)), config_cls, args.config)
        layers.append(file_cfg)
    cli_cfg = OmegaConf.from_dotlist(overrides)
    _check_keys([o.split("=", 1)[0] for o in overrides], config_cls, "command line")
    layers.append(cli_cfg)

    schema = OmegaConf.structured(config_cls)
    try:
        user_cfg = OmegaConf.merge(*layers)
        merged = OmegaConf.merge(schema, user_cfg)
        merged = _apply_presets(merged, user_cfg)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"Missing required config key(s): {', '.join(missing)}")
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except ValidationError as e:
        raise ConfigError(_type_error_message(e, config_cls)) from None
    except ConfigKeyError as e:
        raise ConfigError(f"Config key error: {e.msg} (key {e.full_key!r})") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"Invalid config at {getattr(e, 'full_key', '?')!r}: {e.msg}") from None


def _declared_type(config_cls: type, dotted_key: str) -> Any:
    """The type hint of `dotted_key` in the schema, or None if the key is not found."""
    cls, hint = config_cls, None
    for part in dotted_key.split("."):
        if cls is None:
            return None
        hint = typing.get_type_hints(cls).get(part)
        cls = _dataclass_in(hint) if hint is not None else None
    return hint


def _expected_type(hint: Any) -> str:
    """A type hint for humans, e.g. 'float' or 'int or null'."""
    if hint is None:
        return "?"
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return f"{getattr(args[0], '__name__', args[0])} or null"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _type_error_message(e: ValidationError, config_cls: type) -> str:
    hint = _declared_type(config_cls, str(e.full_key))
    value = getattr(e, "value", None)
    allowed = literal_choices(hint)
    if allowed is not None:
        return str(choice_error(str(e.full_key), value, allowed))
    return (
        f"Wrong type for config key {e.full_key!r}: got {value!r}, expected {_expected_type(hint)}"
    )


def to_yaml(config: Any) -> str:
    """The resolved config as YAML (written next to every run's logs), without the derived
    keys, so that it loads again."""
    tree = OmegaConf.to_container(OmegaConf.structured(config))
    for key in _derived_keys(type(config)):
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return OmegaConf.to_yaml(tree)


# ----------------------------------------------------------------------------- --help


def _help_request(argv: list[str]) -> str | None:
    """None without --help/-h; '' for all sections; the section named after it otherwise."""
    for i, a in enumerate(argv):
        if a in ("--help", "-h"):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if nxt.startswith("-") or "=" in nxt else nxt
    return None


def _type_name(hint: Any) -> str:
    """'float', 'int or null', 'one of [token, sequence]' (the allowed values of a Literal)."""
    allowed = literal_choices(hint)
    if allowed is not None:
        return f"one of [{', '.join(map(str, allowed))}]" + (
            " or null" if type(None) in typing.get_args(hint) else ""
        )
    if hint is Any:
        return "any"
    return _expected_type(hint)


def _default_of(f: dataclasses.Field) -> str:
    """The default as YAML writes it (null, true, 'text'), or '(required)'."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value == "???":
        return "(required)"
    return (
        {None: "null", True: "true", False: "false"}.get(value, repr(value))
        if (value is None or isinstance(value, bool))
        else repr(value)
    )


def _help_lines(cls: type, prefix: str, sections: dict[str, list[str]], section: str) -> None:
    """Append `key: type = default  help` lines of `cls` to `sections`, one section per
    top-level sub-config (scalars at the top level go to 'general')."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or "derived_from" in f.metadata:
            continue
        key, hint, text = prefix + f.name, hints[f.name], f.metadata.get("help", "")
        sub = _dataclass_in(hint)
        if sub is not None:
            name = section if prefix else f.name
            optional = " (optional: null unless set)" if f.default is None else ""
            doc = (sub.__doc__ or "").strip().splitlines()[0] if sub.__doc__ else ""
            if not prefix:
                sections.setdefault(name, []).append(f"[{f.name}]{optional} {doc} {text}".rstrip())
            else:
                sections[name].append(f"  {key}:{optional} {text or doc}".rstrip())
            _help_lines(sub, key + ".", sections, name)
            continue
        line = f"  {key}: {_type_name(hint)} = {_default_of(f)}"
        sections.setdefault(section, []).append(f"{line}\n      {text}" if text else line)


def config_help(config_cls: type, section: str | None = None) -> str:
    """Every key of `config_cls` with type, default and help, grouped by section (`--help`);
    only `section` (e.g. 'actor') when given."""
    sections: dict[str, list[str]] = {"general": ["[general]"]}
    _help_lines(config_cls, "", sections, "general")
    if section is not None:
        if section not in sections:
            raise ConfigError(
                f"--help {section}: no such section of {config_cls.__name__}; sections: "
                f"{', '.join(sections)}"
            )
        return "\n".join(sections[section])
    head = (
        f"{config_cls.__name__}: --config FILE.yaml [key=value ...]; `--help SECTION` shows one "
        f"section ({', '.join(sections)})"
    )
    return "\n\n".join([head, *("\n".join(lines) for lines in sections.values())])
