"""The offline front end's pieces: the CLI in-process, beam scores, the LLM class's home,
the embedded default model's files."""

import os

import pytest

from pagedserve import LLM as FacadeLLM
from pagedserve.frontend.beam_search import BeamSearchSequence, beam_score
from pagedserve.frontend.cli import main
from pagedserve.frontend.llm import LLM
from pagedserve.model_files import default_model_path, is_gguf


def test_cli_generate_prints_what_llm_generates(checkpoint, capsys):
    from pagedserve import SamplingParams

    kw = dict(model=checkpoint("llama"), dtype="float32", num_kv_blocks=64, max_model_len=128)
    want = LLM(**kw).generate(["hello"], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    capsys.readouterr()
    rc = main(["generate", "--model", kw["model"], "--dtype", "float32", "--num-kv-blocks", "64",
               "--max-model-len", "128", "--max-tokens", "6", "--temperature", "0", "--prompt", "hello"])
    assert rc == 0
    assert capsys.readouterr().out == want.outputs[0].text + "\n"


def test_cli_bad_engine_argument_is_exit_2_naming_it(checkpoint, capsys):
    rc = main(["generate", "--model", checkpoint("llama"), "--num-kv-blocks", "1", "--prompt", "x"])
    assert rc == 2 and "num_kv_blocks" in capsys.readouterr().err


def test_beam_score_is_length_normalised_and_counts_eos():
    s = BeamSearchSequence([1, 2, 3], cum_logprob=-3.0)
    assert beam_score(s, None, 1.0) == pytest.approx(-1.0)
    assert beam_score(BeamSearchSequence([1, 2, 9], cum_logprob=-3.0), 9, 1.0) == pytest.approx(-1.5)


def test_the_package_face_is_the_frontends_llm():
    assert FacadeLLM is LLM


def test_the_default_model_ships_inside_a_wheel():
    path = default_model_path()
    assert os.path.exists(path) and is_gguf(path) and not is_gguf(os.path.dirname(path))
