"""Client-server drafting over emulated links (`moa serve-bench`): real sockets on 127.0.0.1 through `DelayProxy`.

For each link profile: server calls per generated token and wall-clock latency per token of the MoA client
(adaptive draft length) against plain server-side generation streamed token by token (the same server and client
with no drafting: one round trip per token). Then drafter-only quality during an outage: the link is cut after some
verified tokens, the client drafts alone, the link comes back and the server verifies; how many offline tokens the
target accepted, and how many equal the target's own greedy tokens at the same positions. Measures; asserts nothing.
"""

from __future__ import annotations

import datetime
import time

import torch

from ..chat import chat_ids
from ..hardware import hardware_info
from .client import MoAClient
from .netem import PROFILES, DelayProxy, netem_available
from .server import ServerThread, ServingState, create_app

__all__ = ["DEFAULT_PROMPTS", "format_report", "run_serving_bench"]

DEFAULT_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short Python function that returns the factorial of n.",
    "List three tips for staying focused while studying.",
    "What is the capital of France, and what is it famous for?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Give me a recipe for a simple tomato soup.",
]


def _summarise(results: list, references: list[list[int]]) -> dict:
    tokens = sum(len(r.token_ids) for r in results)
    calls = sum(r.server_calls for r in results)
    seconds = sum(r.timings["total_s"] for r in results)
    accepted = [a for r in results for a in r.stats["accepted_lengths"]]
    drafts = [d for r in results for d in r.stats["draft_lengths"]]
    return {
        "tokens": tokens,
        "server_calls": calls,
        "calls_per_token": calls / max(tokens, 1),
        "ms_per_token": 1000 * seconds / max(tokens, 1),
        "first_token_ms": 1000 * sum(r.timings["first_token_s"] or 0.0 for r in results) / max(len(results), 1),
        "mean_accepted_length": sum(accepted) / max(len(accepted), 1),
        "mean_draft_length": sum(drafts) / max(len(drafts), 1),
        "bytes_down_per_token": sum(r.stats["bytes_down"] for r in results) / max(tokens, 1),
        "bytes_up_per_token": sum(r.stats["bytes_up"] for r in results) / max(tokens, 1),
        "identical_to_target": all(r.token_ids == ref for r, ref in zip(results, references)),
    }


def _outage_run(
    client: MoAClient, proxy: DelayProxy, prompt: list[int], max_new_tokens: int, after: int, offline_tokens: int
):
    """One generation whose link is cut after `after` verified tokens and restored after `offline_tokens` drafted
    alone. Returns the result and the offline tokens with their positions."""
    events = client.iter_generate(prompt, max_new_tokens)
    offline: list[tuple[int, int]] = []
    cut = restored = False
    while True:
        try:
            event = next(events)
        except StopIteration as stop:
            proxy.set_down(False)
            return stop.value, offline
        if event.kind == "verified" and not cut and event.position + len(event.token_ids) >= after:
            proxy.set_down(True)
            cut = True
        elif event.kind == "unverified" and not restored:
            offline.extend((event.position + i, t) for i, t in enumerate(event.token_ids))
            if len(offline) >= offline_tokens:
                proxy.set_down(False)
                restored = True


def run_serving_bench(
    target,
    tokenizer,
    drafter,
    *,
    profiles=("lan", "4g", "3g", "satellite"),
    num_prompts: int = 3,
    prompts: list[str] | None = None,
    max_new_tokens: int = 32,
    outage_after: int = 8,
    outage_tokens: int = 16,
    drafter_name: str = "",
    log=print,
) -> dict:
    """Run the benchmark (see the module doc); `drafter` is the client's (own embeddings), the server gets a copy
    in the target's dtype. Returns a JSON-able report."""
    texts = (prompts or DEFAULT_PROMPTS)[:num_prompts]
    encoded = [chat_ids(tokenizer, text) for text in texts]
    references = []
    with torch.no_grad():
        for ids in encoded:
            out = target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
            references.append(out[0, len(ids) :].tolist())
    ok, why = netem_available()
    report = {
        "hardware": hardware_info(target.device),
        "target": getattr(target.config, "name_or_path", "") or type(target).__name__,
        "dtype": str(target.dtype).removeprefix("torch."),
        "drafter": drafter_name,
        "max_new_tokens": max_new_tokens,
        "prompts": len(encoded),
        "link_emulation": "asyncio delaying TCP proxy on 127.0.0.1"
        + ("" if not ok else " (tc netem is available here but not used)")
        + ("" if ok else f" (tc netem unavailable: {why})"),
        "profiles": {},
        "date": datetime.date.today().isoformat(),
    }
    server = ServerThread(create_app(ServingState(target, drafter, tokenizer=tokenizer))).start()
    try:
        with MoAClient(server.url, drafter=drafter, tokenizer=tokenizer) as warm:
            warm.generate(encoded[0], 4)
        for name in profiles:
            profile = PROFILES[name]
            entry = {"link": profile.as_dict(), "description": profile.describe(), "methods": {}}
            with DelayProxy(server.port, profile) as proxy:
                for method, length in (("plain", 0), ("moa", None)):
                    t0 = time.perf_counter()
                    with MoAClient(
                        proxy.url, drafter=drafter, tokenizer=tokenizer, draft_length=length, timeout_s=60.0
                    ) as client:
                        results = [client.generate(ids, max_new_tokens) for ids in encoded]
                    entry["methods"][method] = _summarise(results, references)
                    log(
                        f"{name:>9} {method:>5}: {entry['methods'][method]['calls_per_token']:.2f} calls/token, "
                        f"{entry['methods'][method]['ms_per_token']:.1f} ms/token ({time.perf_counter() - t0:.0f} s)"
                    )
                plain, moa = entry["methods"]["plain"], entry["methods"]["moa"]
                entry["speedup"] = plain["ms_per_token"] / max(moa["ms_per_token"], 1e-9)
            report["profiles"][name] = entry
        drafted = accepted = agree = 0
        runs = []
        with DelayProxy(server.port, PROFILES["lan"]) as proxy:
            with MoAClient(proxy.url, drafter=drafter, tokenizer=tokenizer, backoff_max_s=0.2) as client:
                for ids, ref in zip(encoded, references):
                    result, offline = _outage_run(client, proxy, ids, max_new_tokens, outage_after, outage_tokens)
                    spans = result.offline_spans
                    drafted += sum(s["drafted"] for s in spans)
                    accepted += sum(s["accepted"] for s in spans)
                    agree += sum(1 for pos, tok in offline if pos < len(ref) and ref[pos] == tok)
                    runs.append(
                        {
                            "identical_to_target": result.token_ids == ref,
                            "offline_spans": spans,
                            "unverified_tokens": result.unverified_tokens,
                        }
                    )
        report["outage"] = {
            "after_verified_tokens": outage_after,
            "offline_tokens": outage_tokens,
            "drafted_offline": drafted,
            "accepted_on_reconnection": accepted,
            "acceptance": accepted / max(drafted, 1),
            "agreement_with_target": agree / max(drafted, 1),
            "identical_to_target_after_reconnection": all(r["identical_to_target"] for r in runs),
            "runs": runs,
        }
        agreement = report["outage"]["agreement_with_target"]
        log(f"outage: {accepted}/{drafted} offline tokens accepted, agreement with the target {agreement:.2f}")
    finally:
        server.stop()
    return report


def format_report(report: dict) -> str:
    """Markdown tables of a `run_serving_bench` report."""
    lines = [
        f"Target {report['target']} ({report['dtype']}), drafter: {report['drafter']}; {report['prompts']} prompts x "
        f"{report['max_new_tokens']} new tokens, greedy; {report['hardware']['cpu']} ({report['hardware']['cores']} "
        f"cores); links: {report['link_emulation']}.",
        "",
        "| link | profile | method | server calls / token | ms / token | first token ms | mean accepted | "
        "mean draft | bytes down / token | identical to target | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in report["profiles"].items():
        for method, m in entry["methods"].items():
            speedup = f"{entry['speedup']:.2f}x" if method == "moa" else "1.00x"
            lines.append(
                f"| {name} | {entry['description']} | {method} | {m['calls_per_token']:.2f} | {m['ms_per_token']:.1f} "
                f"| {m['first_token_ms']:.0f} | {m['mean_accepted_length']:.2f} | {m['mean_draft_length']:.2f} | "
                f"{m['bytes_down_per_token']:.0f} | {'yes' if m['identical_to_target'] else 'NO'} | {speedup} |"
            )
    o = report.get("outage")
    if o:
        lines += [
            "",
            "| outage | offline tokens | accepted on reconnection | agreement with target | identical after |",
            "|---|---|---|---|---|",
            f"| cut after {o['after_verified_tokens']} verified tokens, {o['offline_tokens']} drafted alone | "
            f"{o['drafted_offline']} | {o['accepted_on_reconnection']} ({100 * o['acceptance']:.0f}%) | "
            f"{100 * o['agreement_with_target']:.0f}% | "
            f"{'yes' if o['identical_to_target_after_reconnection'] else 'NO'} |",
        ]
    return "\n".join(lines)
