"""Each config default has one home (the section's dataclass), and the shipped configs still
resolve to what they did before it moved there (issue 49): tests/fixtures/shipped_configs.json
holds every key of every shipped config and its variants (configs/demo.py's own test runs it),
dumped at 8b1a3e8 (value, its type,
and the type the ConfigDict locks the key to, which ``--config.SECTION.KEY=VALUE`` parses by)."""
import dataclasses
import importlib
import json
import os
import sys

import ml_collections
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "shipped_configs.json")
VARIANTS = {"base": [None, "filter"], "stage1": [None, "filter"], "stage2": [None, "filter"],
            "stage3": [None, "filter"], "eval": [None], "sft": [None]}


def flat(c, prefix=""):
    """Every leaf of a ConfigDict: dotted key -> [repr(value), its type, the key's locked type]."""
    out = {}
    for k in sorted(c.keys()):
        v = c[k]
        if isinstance(v, ml_collections.ConfigDict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = [repr(v), type(v).__name__, c.get_ref(k).get_type().__name__]
    return out


def dump() -> dict:
    return {f"{name}:{arg or ''}": flat(importlib.import_module(name).get_config(arg))
            for name, args in VARIANTS.items() for arg in args}


def test_shipped_configs_resolve_as_before():
    with open(FIXTURE) as f:
        before = json.load(f)
    now = dump()
    assert sorted(now) == sorted(before)
    for variant in before:  # a key added since is a new dataclass field: in every config at its default
        changed = {k: (old, now[variant].get(k)) for k, old in before[variant].items() if now[variant].get(k) != old}
        assert not changed, f"{variant}: {changed}"


if __name__ == "__main__":  # python tests/test_config_defaults.py > tests/fixtures/shipped_configs.json
    print(json.dumps(dump(), indent=0, sort_keys=True))


def test_lower_layers_name_settings_and_the_recipes_write_them_as_flags():
    """Below recipes/ a setting is named in the config's terms (``serving.kv_pages``); the recipes
    turn it into its flag, and only a real key of a section (not ``serving.sizing``)."""
    from rstarjax.recipes.config import as_flags
    from rstarjax.rl.config import RLConfig
    from rstarjax.validation import ConfigError
    assert as_flags("set serving.kv_pages=896, or lower rl.max_prompt_len / rl.max_response_len (serving.sizing); "
                    "jax.distributed (distributed.*)") == (
        "set --config.serving.kv_pages=896, or lower --config.rl.max_prompt_len / --config.rl.max_response_len "
        "(serving.sizing); jax.distributed (--config.distributed.*)")
    assert as_flags("--config.rl.roc=False, rl.step, model.hf_path") == "--config.rl.roc=False, rl.step, --config.model.hf_path"
    with pytest.raises(ConfigError) as e:  # the rl section's own rule names a sibling setting ...
        RLConfig(oversample=24)
    assert "--config." not in str(e.value) and "rl.roc=False" in str(e.value)
    import stage1  # ... and the run's parse prints it as the flag
    c = stage1.get_config()
    c.rl.oversample = 24
    from rstarjax.recipes.config import parse
    with pytest.raises(ConfigError, match="or set --config.rl.roc=False"):
        parse(c)



# not yet: the transport's own messages (issue 49 item 3 moves them; their helper owns the files)
FLAGS_LEFT_BELOW_RECIPES: set[str] = set()  # none left


def test_no_flag_is_spelled_below_the_recipes():
    """The layers below recipes/ name a setting as ``SECTION.KEY``, never as a ``--config.`` flag
    (``as_flags`` writes it so, in the recipes)."""
    import re
    spelled = []
    for layer in ("rl", "serving", "env", "models", "io"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, "rstarjax", layer)):
            for name in sorted(files):
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
                if name.endswith(".py") and rel not in FLAGS_LEFT_BELOW_RECIPES:
                    with open(os.path.join(ROOT, rel)) as f:
                        spelled += [f"{rel}: {m}" for m in re.findall(r"--config\.[\w.*]+", f.read())]
    assert not spelled, spelled
