"""EngineArgs: one registry for the CLI flags and LLM(**kwargs)."""

import argparse
import dataclasses
import inspect
import json

import pytest

from pagedserve import LLM
from pagedserve.config import parse_bytes
from pagedserve.engine_args import VLLM_ONLY_ARGS, EngineArgs


def _non_default(f: dataclasses.Field):
    """A value different from the field's default, of the field's type."""
    md = f.metadata
    if f.type in ("bool", "bool | None"):
        return not bool(f.default)
    if md.get("choices"):
        return next(c for c in md["choices"] if c != f.default)
    if f.name == "kv_cache_memory_bytes":
        return 3 << 30
    if f.type.startswith("dict"):
        return {"method": "ngram", "num_speculative_tokens": 2}
    if f.type.startswith("int"):
        return (f.default or 0) + 7
    if f.type.startswith("float"):
        return 0.25 if f.default == 0.5 else 0.5
    return f"x-{f.name}"


def _flag_value(v):
    return json.dumps(v) if isinstance(v, dict) else str(v)


@pytest.mark.parametrize("field", dataclasses.fields(EngineArgs), ids=lambda f: f.name)
def test_every_cli_flag_maps_to_its_llm_keyword(field):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    value = _non_default(field)
    flag = "--" + field.name.replace("_", "-")
    if isinstance(value, bool):
        argv = [flag if value else "--no-" + field.name.replace("_", "-")]
    else:
        argv = [flag, _flag_value(value)]
    from_cli = EngineArgs.from_cli_args(parser.parse_args(argv))
    from_kwargs = EngineArgs.from_kwargs(**{field.name: value})
    assert from_cli == from_kwargs
    assert getattr(from_cli, field.name) == value != field.default


def test_defaults_agree_and_positional_model():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, model_positional=True)
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()
    assert EngineArgs.from_cli_args(parser.parse_args(["/m"])).model == "/m"
    # vLLM's older spellings still work
    ns = parser.parse_args(["--no-prefix-caching", "--kv-cache-memory", "1GiB"])
    assert EngineArgs.from_cli_args(ns) == EngineArgs(enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30)


def test_llm_signature_is_generated_from_the_dataclass():
    params = inspect.signature(LLM.__init__).parameters
    assert list(params)[1:] == [f.name for f in dataclasses.fields(EngineArgs)]
    assert params["max_num_seqs"].default == 256


def test_unsupported_vllm_argument_is_named():
    with pytest.raises(ValueError, match="vLLM engine argument.*trust_remote_code"):
        LLM("default", trust_remote_code=True)
    with pytest.raises(ValueError, match="unknown engine argument.*max_nun_seqs"):
        LLM("default", max_nun_seqs=3)
    assert "pipeline_parallel_size" in VLLM_ONLY_ARGS


def test_speculative_config_is_validated():
    with pytest.raises(ValueError, match="unsupported key"):
        EngineArgs(speculative_config={"method": "ngram", "bogus": 1}).create_engine_config()
    with pytest.raises(ValueError, match="method"):
        EngineArgs(speculative_config={"method": "eagle"}).create_engine_config()
    cfg = EngineArgs(speculative_config={"num_speculative_tokens": 5}).create_engine_config()
    assert cfg.speculative.num_speculative_tokens == 5 and cfg.speculative.method == "ngram"


def test_tensor_parallel_size_reaches_the_config():
    assert EngineArgs(tensor_parallel_size=2).create_engine_config().parallel.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineArgs(tensor_parallel_size=0).create_engine_config()


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1e9") == 10**9
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_kv_cache_dtype_argument():
    from pagedserve.engine_args import EngineArgs

    assert EngineArgs(kv_cache_dtype="float16").create_engine_config().cache.kv_cache_dtype == "float16"
    assert EngineArgs(kv_cache_dtype="fp8").create_engine_config().cache.kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2, got 'int8'"):
        EngineArgs(kv_cache_dtype="int8").create_engine_config()


def test_every_setting_is_written_once():
    """Each EngineArgs field is a config field's (same default, choices, type and help:
    the same metadata object's contents), or one of the two front-end-only fields; and
    every user-facing config field is reachable from EngineArgs."""
    from pagedserve.config import default_of
    from pagedserve.engine_args import SECTIONS

    own = {"engine_core_process", "speculative_config", "task"}
    seen = set()
    for f in dataclasses.fields(EngineArgs):
        if f.name in own:
            assert "source" not in f.metadata
            continue
        section, name = f.metadata["source"]
        cfg = {g.name: g for g in dataclasses.fields(SECTIONS[section])}[name]
        assert f.default == default_of(cfg), f.name
        assert {k: v for k, v in f.metadata.items() if k != "source"} == dict(cfg.metadata), f.name
        assert f.type == cfg.type, f"{f.name}: {f.type} vs {cfg.type}"
        seen.add((section, name))
    for section, cls in SECTIONS.items():
        for g in dataclasses.fields(cls):
            assert (section, g.name) in seen, f"{section}.{g.name} has no engine argument"


def test_a_bad_choice_names_the_engine_argument():
    for kw, name in [
        ({"scheduling_policy": "sjf"}, "scheduling_policy"),
        ({"dp_routing": "random"}, "dp_routing"),
        ({"quantization": "int3"}, "quantization"),
        ({"dtype": "float8"}, "dtype"),
        ({"block_size": 24}, "block_size"),
        ({"structured_outputs_backend": "outlines"}, "structured_outputs_backend"),
    ]:
        with pytest.raises(ValueError, match=f"^{name} must be one of"):
            EngineArgs(**kw).create_engine_config()
