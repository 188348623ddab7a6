import pytest
import torch

from pagedserve import LLM, BeamSearchParams
from tests.checkpoints import load_hf


@pytest.mark.parametrize("width", [2, 4])
def test_best_beam_matches_transformers(checkpoint, width):
    path = checkpoint("llama")
    hf = load_hf(path)
    llm = LLM(path, dtype="float32", num_kv_blocks=400)
    prompts = [[(7 * i + 3) % 1000 for i in range(21)], [5, 9, 11]]
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True),
    )
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([p]),
                num_beams=width,
                do_sample=False,
                max_new_tokens=10,
                length_penalty=1.0,
                early_stopping=False,
                eos_token_id=None,
                pad_token_id=0,
                num_return_sequences=width,
            )
        assert out.sequences[0].tokens == ref[0].tolist()
        assert len(out.sequences) == width
        scores = [s.cum_logprob for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
    s = llm.get_stats()
    assert s.kv_blocks_used == 0 and s.prefix_cache_hits > 0  # beams forked over cached blocks
