"""On a CUDA device (skipped without one): the speculative engine and the `assistant_model` path with this library's
drafters produce plain greedy decoding's tokens in float32, at batch 1 and for a left-padded batch, with costs the
engine measures there (synchronised: a CUDA device runs kernels after the host has moved on)."""

import pytest
import torch
from test_engine import FLAT_COSTS, _left_pad, _peaked
from test_engine_drafters import _eagle, _moa

import moa_hf
from moa_hf.costs import measure_costs
from moa_hf.modeling.custom_generate.policy import wall_times

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _pair(family: str, kind: str):
    target = _peaked(family)
    drafter = (_moa if kind == "moa" else _eagle)(target)
    return target.to(CUDA), drafter.to(CUDA)


def _prompts(target):
    torch.manual_seed(2)
    seed = torch.randint(3, 128, (4,), device=CUDA)
    loop = target.generate(seed[None], max_new_tokens=24, do_sample=False)[0]  # a peaked target repeats itself
    loop = torch.where(loop < 3, loop + 3, loop)  # no pad (0) inside a prompt
    return [loop[:10], loop[2:24], torch.randint(3, 128, (15,), device=CUDA)]


@pytest.mark.parametrize("settings", [{}, {"tree_depth": 3, "tree_top_k": 3, "tree_budget": 8, "costs": FLAT_COSTS}])
@pytest.mark.parametrize("kind", ["moa", "eagle"])
@pytest.mark.parametrize("family", ["llama", "gemma3-sliding"])
def test_engine_on_cuda_equals_generate(family, kind, settings):
    target, drafter = _pair(family, kind)
    prompts = _prompts(target)
    refs = [target.generate(p[None], max_new_tokens=20, do_sample=False)[0, p.shape[0] :] for p in prompts]
    kwargs = dict(do_sample=False, max_new_tokens=20, **settings)
    out = moa_hf.generate(target, drafter, prompts[1][None], return_dict_in_generate=True, **kwargs)
    assert out.sequences.device.type == "cuda"
    assert out.sequences[0, prompts[1].shape[0] :].tolist() == refs[1].tolist()
    if "costs" not in settings:  # measured on the device: every size took time
        assert all(t > 0 for t in (*out.costs.verify.values(), *out.costs.step.values()))
    else:  # a fixed tree shape: drafted trees were verified (measured costs may choose plain decoding)
        assert sum(out.speculation_stats[0].tree_sizes) > 0
    ids, mask = _left_pad([p.cpu() for p in prompts])
    out = moa_hf.generate(target, drafter, ids.to(CUDA), attention_mask=mask.to(CUDA), **kwargs)
    for b, ref in enumerate(refs):
        assert out[b, ids.shape[1] :].tolist() == ref.tolist(), f"row {b}"


def test_assistant_path_on_cuda_equals_generate():
    target, drafter = _pair("llama", "moa")
    for prompt in _prompts(target):
        ref = target.generate(prompt[None], max_new_tokens=20, do_sample=False)
        with moa_hf.attached(drafter, target):
            out = target.generate(prompt[None], max_new_tokens=20, do_sample=False, assistant_model=drafter)
            assert drafter.speculation_stats.drafted_tokens > 0  # it drafted (the stats go with the attachment)
        assert out.tolist() == ref.tolist()


def test_wall_times_waits_for_the_device():
    """The engine's timings (`wall_times`) wait for each call's queued kernels: the test does no waiting of its own,
    it watches the stream. Each timed call starts on an idle stream (the wait after the previous call emptied it),
    nothing is queued when `wall_times` returns, and the times cover the device's work (CUDA events)."""
    x = torch.randn(4096, 4096, device=CUDA)
    stream = torch.cuda.current_stream()
    idle_at_start = []

    def work():
        idle_at_start.append(stream.query())
        for _ in range(8):
            x @ x  # ~1 TFLOP: milliseconds of device time, microseconds to queue

    times = wall_times(work, CUDA, repeats=3)
    assert stream.query(), "wall_times returned with the last call's kernels still queued"
    assert idle_at_start[1:] == [True, True, True], "a timed call started before the previous one's kernels ran"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    assert times[0] >= 0.5 * start.elapsed_time(end) / 1000  # not just the time to queue the kernels


def test_measured_costs_on_cuda():
    target, drafter = _pair("llama", "moa")
    with moa_hf.attached(drafter, target):
        result = measure_costs(target, drafter, _prompts(target)[1][None], repeats=2, gen_tokens=8)
    assert result["target_decode_step_ms"] > 0 and result["engine"]["cycles"] >= 1
    assert all(t > 0 for t in result["engine"]["target_verify_ms"].values())


@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_engine_samples_on_cuda(kind):
    """Sampling (the tree's multi-candidate rule, logits processors) runs on the device: every row gets its tokens,
    all within top-k of the target's distribution after its prefix."""
    target, drafter = _pair("llama", kind)
    ids, mask = _left_pad([p.cpu() for p in _prompts(target)])
    ids, mask = ids.to(CUDA), mask.to(CUDA)
    torch.manual_seed(0)
    out = moa_hf.generate(
        target, drafter, ids, attention_mask=mask, do_sample=True, top_k=4, temperature=0.8, max_new_tokens=12,
        tree_depth=3, tree_top_k=2, tree_budget=6, costs=FLAT_COSTS,
    )  # fmt: skip
    assert out.device == ids.device and out.shape == (3, ids.shape[1] + 12)
    full_mask = torch.cat([mask, torch.ones(3, 12, dtype=mask.dtype, device=CUDA)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)  # as `generate` numbers a left-padded row
    logits = target(out, attention_mask=full_mask, position_ids=positions).logits[:, ids.shape[1] - 1 : -1]
    top = logits.topk(4, dim=-1).indices  # [3, 12, 4]
    assert (top == out[:, ids.shape[1] :, None]).any(-1).all()  # every sampled token is one of the 4 allowed
