"""Config composition: `defaults:` bases, deep merge, verl key aliases, unknown keys with a suggestion.

A YAML may name bases and hold only its differences, as verl/Hydra users write it:

    defaults: [tiny_cpu]        # next to this file, '.yaml' optional; several bases apply in order
    algorithm:
      adv_estimator: rloo       # this file's own keys go on top (dicts deep-merged, lists replaced)

Bases may have bases (a cycle is an error). verl's `actor_rollout_ref.{actor,rollout,model}.X` is
accepted, in a YAML file or a `key=value` override, wherever rlake has the key `{actor,rollout,model}.X`.
Any other unknown key fails before pydantic with a what / why / fix message and a close valid key.
Schema-agnostic: every function takes the root pydantic model, so `schema.py` imports this module.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import InitErrorDetails, ValidationError

Tree = dict[str, Any]
Model = type[BaseModel]

DEFAULTS_KEY = "defaults"
VERL_ROOT = "actor_rollout_ref"
VERL_SECTIONS = {"actor": "actor", "rollout": "rollout", "model": "model"}
"""verl's actor_rollout_ref.<sub> -> rlake section. verl's `ref` has no counterpart: rlake's reference
policy is the initial policy (policy_v0) and has no settings of its own."""
VERL_RENAMED = {
    "model.lora_rank": "actor.lora.rank",
    "model.lora_alpha": "actor.lora.alpha",
    "model.target_modules": "actor.lora.target_modules",
}
"""verl keys (after the section mapping) whose rlake name differs: LoRA sits under actor.lora."""


# ---- trees ---------------------------------------------------------------------------------------


def deep_merge(base: Tree, top: Tree) -> Tree:
    """`top` over `base` in a new tree: nested dicts merge key by key, anything else (lists too) is replaced."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        both = isinstance(out.get(key), dict) and isinstance(value, dict)
        out[key] = deep_merge(out[key], value) if both else copy.deepcopy(value)
    return out


def flatten(tree: Tree, prefix: str = "") -> dict[str, Any]:
    """Leaves of `tree` as {'a.b.c': value}, in tree order (empty dicts contribute nothing)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def set_dotted(tree: Tree, dotted: str, value: Any) -> None:
    """tree['a']['b'] = value for dotted 'a.b', creating sections on the way."""
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"override '{dotted}': '{key}' is not a section")
    node[keys[-1]] = value


def yaml_scalar(value: Any) -> str:
    """One-line YAML for a leaf value (JSON, which YAML reads, when YAML would need several lines)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()
    return json.dumps(value) if "\n" in text else text


# ---- files and bases -----------------------------------------------------------------------------


def read_yaml(path: Path) -> Tree:
    """The mapping in YAML file `path` (an empty file is {})."""
    if not path.is_file():
        raise FileNotFoundError(f"config file '{path}' does not exist; pass a path under configs/")
    tree = yaml.safe_load(path.read_text()) or {}
    if not isinstance(tree, dict):
        raise ValueError(f"config file '{path}' must hold a mapping at top level, got {type(tree).__name__}")
    return tree


def base_paths(path: Path, names: Any) -> list[Path]:
    """Files named by the `defaults:` entry of `path`: a name or a list, relative to its directory."""
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"'{DEFAULTS_KEY}' in '{path}' must be a config name or a list of names (got {names!r}), "
            "because each entry names a base YAML next to it; write e.g. defaults: [tiny_cpu]."
        )
    if "_self_" in names[:-1]:
        raise ValueError(
            f"'_self_' in the defaults of '{path}' must come last or not at all, because rlake "
            "always applies a file's own keys after its bases; move or remove it."
        )
    out = []
    for name in (n for n in names if n != "_self_"):
        base = path.parent / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
        if not base.is_file():
            near = sorted(p.stem for p in path.parent.glob("*.yaml"))
            raise FileNotFoundError(
                f"base config '{name}' in the defaults of '{path}' does not exist (looked for "
                f"'{base}'), because bases are resolved next to the file; use one of {near}."
            )
        out.append(base.resolve())
    return out


def compose_bases(path: Path, names: Any, model: Model, chain: tuple[Path, ...] = ()) -> Tree:
    """The merged trees of the bases `names` of file `path`, in order (later over earlier)."""
    tree: Tree = {}
    for base in base_paths(path, names):
        tree = deep_merge(tree, load_tree(base, model, (*chain, path)))
    return tree


def load_tree(path: str | Path, model: Model, chain: tuple[Path, ...] = ()) -> Tree:
    """The tree of YAML `path`: its bases (recursively), then its own keys with verl names translated."""
    path = Path(path).resolve()
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain[chain.index(path) :], path))
        raise ValueError(
            f"config bases form a cycle: {cycle}, so no file can be resolved first; remove one "
            f"'{DEFAULTS_KEY}' entry of the cycle."
        )
    own = read_yaml(path)
    bases = compose_bases(path, own.pop(DEFAULTS_KEY, []), model, chain)
    return deep_merge(bases, translate_verl_keys(own, model))


def apply_overrides(tree: Tree, overrides: Iterable[str], model: Model) -> Tree:
    """`key.sub=value` overrides (values parsed by `override_value`, verl names translated) applied in order."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        key = verl_alias(key.strip(), model) or key.strip()
        set_dotted(tree, key, override_value(raw, leaf_is_str(key, model)))
    return tree


HASH_STANDIN = "\ue000"
"""A private-use character that stands in for '#' while a value is parsed (no YAML syntax uses it)."""


def override_value(raw: str, is_str: bool = False) -> Any:
    """The value of a `key=value` override, as the user meant it.

    Parsed as YAML (`3` an int, `[a, b]` a list, `null` None, quotes stripped), except:
    - '#' is text, never a YAML comment: the shell removed comments already, so `x=#### (\\d+)` is that
      string (YAML alone reads None) and `x=a #b` is 'a #b' (YAML alone: 'a');
    - for a key whose schema type is `str`, text YAML would read as another type is kept as typed: `Score: (\\d+)`
      stays a string (YAML alone reads the mapping {'Score': '(\\d+)'}), `123` is '123', an empty value ''."""
    try:
        value = _restore_hash(yaml.safe_load(raw.replace("#", HASH_STANDIN)))
    except yaml.YAMLError as exc:
        if is_str:
            return raw
        raise ValueError(
            f"override value {raw!r} is not valid YAML ({str(exc).splitlines()[0]}), and it is read as YAML so "
            "that numbers, lists and null keep their types; quote it for a string (key='\"text\"'), or close "
            "the bracket or quote it opens"
        ) from None
    if is_str and not isinstance(value, str):
        return raw
    return value


def _restore_hash(value: Any) -> Any:
    """`value` with HASH_STANDIN turned back into '#' in every string, key and item."""
    if isinstance(value, str):
        return value.replace(HASH_STANDIN, "#")
    if isinstance(value, list):
        return [_restore_hash(v) for v in value]
    if isinstance(value, dict):
        return {_restore_hash(k): _restore_hash(v) for k, v in value.items()}
    return value


# ---- the schema's keys and verl names ------------------------------------------------------------


def sub_model(annotation: Any) -> Model | None:
    """The pydantic model a field holds (`X` or `X | None`), or None for a leaf."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


@functools.cache
def schema_keys(model: Model) -> dict[str, bool]:
    """Every dotted key of `model` in schema order -> True for a leaf, False for a section."""
    out: dict[str, bool] = {}
    for name, field in model.model_fields.items():
        sub = sub_model(field.annotation)
        out[name] = sub is None
        if sub is not None:
            out.update({f"{name}.{key}": leaf for key, leaf in schema_keys(sub).items()})
    return out


def leaf_is_str(key: str, model: Model) -> bool:
    """Whether dotted `key` is a leaf of `model` whose type is exactly `str` (not `str | None`, not a Literal)."""
    node: Model | None = model
    parts = key.split(".")
    for part in parts[:-1]:
        field = node.model_fields.get(part) if node is not None else None
        node = sub_model(field.annotation) if field is not None else None
    field = node.model_fields.get(parts[-1]) if node is not None else None
    return field is not None and field.annotation is str


def verl_alias(key: str, model: Model) -> str | None:
    """rlake's key for verl's `actor_rollout_ref.<sub>.X` when it exists (`rollout.n`), else None."""
    parts = key.split(".")
    if len(parts) < 3 or parts[0] != VERL_ROOT or parts[1] not in VERL_SECTIONS:
        return None
    target = ".".join([VERL_SECTIONS[parts[1]], *parts[2:]])
    target = VERL_RENAMED.get(target, target)
    return target if target in schema_keys(model) else None


def translate_verl_keys(tree: Tree, model: Model) -> Tree:
    """`tree` with its `actor_rollout_ref` leaves moved to rlake keys; untranslatable ones stay for the error."""
    verl = tree.get(VERL_ROOT)
    if not isinstance(verl, dict):
        return tree
    out = copy.deepcopy({k: v for k, v in tree.items() if k != VERL_ROOT})
    rest: Tree = {}
    for key, value in flatten(verl, f"{VERL_ROOT}.").items():
        target = verl_alias(key, model)
        if target is not None and target in flatten(out):
            raise ValueError(
                f"config key '{target}' is set twice, directly and as verl's '{key}', so which "
                "value applies would be ambiguous; keep one of the two."
            )
        set_dotted(out if target else rest, target or key, value)
    return {**out, **rest}


# ---- unknown keys --------------------------------------------------------------------------------


def unknown_keys(tree: Tree, model: Model, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of every leaf of `tree` that `model` does not define."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        field = model.model_fields.get(key)
        sub = sub_model(field.annotation) if field is not None else None
        if field is None:
            out.update(flatten({key: value}, prefix) or {f"{prefix}{key}": value})
        elif sub is not None and isinstance(value, dict):
            out.update(unknown_keys(value, sub, f"{prefix}{key}."))
    return out


def _rlake_form(key: str) -> str:
    """`key` with a verl `actor_rollout_ref.<sub>.` prefix replaced by rlake's section (else unchanged)."""
    parts = key.split(".")
    if parts[0] == VERL_ROOT and len(parts) > 2 and parts[1] in VERL_SECTIONS:
        return ".".join([VERL_SECTIONS[parts[1]], *parts[2:]])
    return key


def suggest_key(key: str, model: Model) -> str | None:
    """The valid leaf key closest to `key`: by the whole dotted key (in its rlake form), else by the
    leaf name alone (`ppo_mini_batch` -> `actor.ppo_mini_batch_size`), preferring `key`'s own section."""
    leaves = [k for k, leaf in schema_keys(model).items() if leaf]
    form = _rlake_form(key)
    close = difflib.get_close_matches(form, leaves, n=1, cutoff=0.8)
    if close:
        return close[0]
    names = difflib.get_close_matches(form.rsplit(".", 1)[-1], {k.rsplit(".", 1)[-1] for k in leaves}, n=1)
    same_leaf = [k for k in leaves if names and k.rsplit(".", 1)[-1] == names[0]]
    return max(same_leaf, key=lambda k: _shared_parts(k, form), default=None)


def _shared_parts(a: str, b: str) -> int:
    """How many leading dotted parts `a` and `b` share."""
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def _valid_here(key: str, model: Model) -> list[str]:
    """Direct children of the deepest schema section that `key` (in its rlake form) lies in."""
    keys, parts = schema_keys(model), _rlake_form(key).split(".")
    for depth in range(len(parts) - 1, 0, -1):
        section = ".".join(parts[:depth])
        if keys.get(section) is False:
            return [k for k in keys if k.startswith(f"{section}.") and "." not in k[len(section) + 1 :]]
    return [k for k in keys if "." not in k]


def _verl_note(key: str) -> str:
    """Why a verl-style `key` did not translate ('' for other keys)."""
    parts = key.split(".")
    if parts[0] != VERL_ROOT or len(parts) < 3:
        return ""
    if parts[1] == "ref":
        return (
            f"verl's {VERL_ROOT}.ref.* has no rlake counterpart (the reference policy is the initial policy, "
            "policy_v0, with no settings of its own); "
        )
    if parts[1] in VERL_SECTIONS:
        return f"verl's {VERL_ROOT}.{parts[1]}.* maps to rlake's {VERL_SECTIONS[parts[1]]}.*, which has no such key; "
    return f"verl's {VERL_ROOT}.{parts[1]} is not one of {sorted([*VERL_SECTIONS, 'ref'])}; "


def unknown_key_message(key: str, value: Any, model: Model) -> str:
    """What / why / fix for one unknown key, with the closest valid key."""
    close = suggest_key(key, model)
    hint = f"did you mean '{close}'?" if close else f"valid keys here: {_valid_here(key, model)}"
    return (
        f"unknown config key '{key}' (value {value!r}): configs reject unknown keys so a typo cannot be "
        f"silently ignored; {_verl_note(key)}{hint} (`rlake config` prints every key)"
    )


def check_known_keys(tree: Tree, model: Model) -> None:
    """Raise a pydantic ValidationError naming every unknown key of `tree`, each with a suggestion."""
    unknown = unknown_keys(tree, model)
    if unknown:
        errors: list[InitErrorDetails] = [
            {
                "type": "value_error",
                "loc": tuple(key.split(".")),
                "input": value,
                "ctx": {"error": ValueError(unknown_key_message(key, value, model))},
            }
            for key, value in unknown.items()
        ]
        raise ValidationError.from_exception_data(model.__name__, errors)
