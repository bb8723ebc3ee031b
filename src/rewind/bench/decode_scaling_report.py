"""The Markdown page of `rewind bench decode-scaling`, written beside its JSON report: tokens/s per
stream count against the HBM bound, the bound's arithmetic, where an engine step goes, and the
kernel trace.
"""

from __future__ import annotations

from typing import Any

from rewind.bench.decode_scaling_bound import StreamBytes

def _cell(row: dict[str, Any] | None) -> str:
    if not row:
        return "-"
    if "tok_s" not in row:
        return "failed"
    return f"{row['tok_s']:,.0f} ({100 * row['of_bound']:.0f}%)"


def _bandwidth_of(report: dict[str, Any]) -> str:
    gpu = report.get("gpu")
    if report.get("hbm_card"):
        return f"the {gpu}'s datasheet bandwidth"
    return (f"an H200's datasheet bandwidth; this card, {gpu}, is not in the table" if gpu
            else "an H200's datasheet bandwidth")


def markdown(report: dict[str, Any]) -> str:
    hbm = report["hbm_bytes_per_s"]
    lines = ["# Decode tokens/s at 1, 8 and 32 concurrent streams", "",
             f"Command: `{report['command']}`" + (f" at {report['commit']}"
                                                  if report.get("commit") else ""), "",
             f"Random-weight bf16 models of real shapes; {report['prompt_tokens']}-token "
             f"distinct random prompts arriving together, greedy, timed over the window where "
             f"every stream decodes (at least {report['decode_tokens']} steps). Cells: tokens/s of all "
             "streams together (share of the HBM bound at that row's mean context).", ""]
    # int keys: a report read back from JSON has them as strings
    quoted = {int(k): v for k, v in report["llama_cpp_quoted"]["decode_tok_s"].items()}
    for name, entry in report["models"].items():
        sizes = StreamBytes(**entry["bytes"])
        lines += [f"## {name}", "", f"{entry['compute']}. Weights read per step "
                  f"{sizes.weight_bytes / 1e9:.3f} GB; per stream "
                  f"{sizes.kv_bytes_per_token / 1e3:.1f} kB of KV per token held"
                  + (f" + {sizes.fixed_state_bytes / 1e6:.1f} MB of linear-attention state"
                     if sizes.fixed_state_bytes else "") + ".", ""]
        header = ["streams", "Rewind engine (EOS bias)", "Rewind engine (plain greedy)",
                  "Rewind HTTP (openai client)", "mlx-lm BatchGenerator", "HBM bound"]
        # the decode step's two settings side by side, where measured (REWIND_COMPILED_DECODE)
        settings = [(part, title) for part, title in (
            ("uncompiled", "Rewind engine, plain decode step (EOS bias)"),
            ("compiled", "Rewind engine, compiled decode step (EOS bias)"),
            ("fused", "Rewind engine, q/k/v and gate/up fused (EOS bias)"),
            ("unfused", "Rewind engine, q/k/v and gate/up unfused (EOS bias)"),
            ("plain-blocks", "Rewind engine, mlx-lm's blocks, REWIND_FUSED_DECODE=off (EOS bias)"),
            ("skinny", "Rewind engine, Rewind's batch products, REWIND_SKINNY_PRODUCTS=on "
                       "(EOS bias)"))
            if any(part in parts for parts in entry["rows"].values())]
        header[2:2] = [title for _, title in settings]
        measured = any("llama.cpp" in parts for parts in entry["rows"].values())
        if measured:
            header.append("llama.cpp, F16, same weights (llama-batched-bench)")
        elif name.startswith("llama"):
            header.append("llama.cpp CUDA, F16, 32k vocab (quoted)")
        lines += ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]
        for count, parts in sorted(entry["rows"].items(), key=lambda kv: int(kv[0])):
            n = int(count)
            context = (parts.get("engine") or parts.get("uncompiled") or parts.get("greedy")
                       or parts.get("mlx-lm") or {}).get("mean_context", report["prompt_tokens"])
            bound = sizes.bound_tok_s(n, context, hbm)
            cells = [count, _cell(parts.get("engine")), _cell(parts.get("greedy")),
                     _cell(parts.get("http")), _cell(parts.get("mlx-lm")),
                     f"{bound:,.0f} (at {context:.0f} tokens)"]
            cells[2:2] = [_cell(parts.get(part)) for part, _ in settings]
            if measured:
                cells.append(_cell(parts.get("llama.cpp")))
            elif name.startswith("llama"):
                cells.append(f"{quoted[n]:,}" if n in quoted else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Bound arithmetic (bytes read per step / "
                  f"{hbm / 1e12:.2f} TB/s, {_bandwidth_of(report)}):", ""]
        for count, parts in sorted(entry["rows"].items(), key=lambda kv: int(kv[0])):
            n = int(count)
            context = (parts.get("engine") or parts.get("uncompiled") or parts.get("greedy")
                       or parts.get("mlx-lm") or {}).get("mean_context", report["prompt_tokens"])
            step = sizes.step_bytes(n, context)
            state = (f"{n} x ({sizes.kv_bytes_per_token} B x {context:.0f} tokens"
                     + (f" + {sizes.fixed_state_bytes} B" if sizes.fixed_state_bytes else "")
                     + ")")
            lines.append(f"- N={n}: ({sizes.weight_bytes} B + {state}) = {step / 1e9:.3f} GB "
                         f"-> {1e3 * step / hbm:.3f} ms a step -> {n} / that = "
                         f"{sizes.bound_tok_s(n, context, hbm):,.0f} tok/s")
        per_step = [(count, part, parts[part]["per_step"]) for count, parts in
                    sorted(entry["rows"].items(), key=lambda kv: int(kv[0]))
                    for part in ("engine", "uncompiled", "compiled", "fused", "unfused",
                                 "plain-blocks", "skinny")
                    if part in parts and parts[part].get("per_step", {}).get("steps")]
        if per_step:
            lines += ["", "Where an engine decode step goes (mean ms per step of the window, "
                      "timers on the engine thread; the median and slowest step beside):", "",
                      "| streams | step | schedule | run (forward) | postprocess (sample, "
                      "emit) | between steps | step median / max |",
                      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for count, part, p in per_step:
                if "run_ms" not in p:  # a report from before the step was three calls
                    continue
                spread = (f"{p['step_ms_p50']:.2f} / {p['step_ms_max']:.2f}"
                          if "step_ms_p50" in p else "-")
                label = f"{count}" + ("" if part == "engine" else f" {part}")
                lines.append(f"| {label} | {p['step_ms']:.2f} | {p['schedule_ms']:.2f} | "
                             f"{p['run_ms']:.2f} | {p['postprocess_ms']:.2f} | "
                             f"{p['between_steps_ms']} | {spread} |")
        mlx_steps = [(count, parts["mlx-lm"]["step_ms"]) for count, parts in
                     sorted(entry["rows"].items(), key=lambda kv: int(kv[0]))
                     if "step_ms" in parts.get("mlx-lm", {})]
        if mlx_steps:
            lines += ["", "mlx-lm BatchGenerator step: " + ", ".join(
                f"N={c}: {ms:.2f} ms" for c, ms in mlx_steps) + "."]
        kernels = entry.get("kernels")
        if kernels:
            lines += ["", "### CUDA kernel trace (benchmarks/probes/decode_kernels.py)", ""]
            lines += kernel_markdown(kernels)
        llama = entry.get("llama_cpp")
        if llama:
            lines += ["", f"llama.cpp: `{llama['command']}` ({llama['version']})"
                      + (f"; failed: {llama['error']}" if "error" in llama else "")
                      + ". Its decode steps compute logits for every row and sample nothing; "
                      "Rewind's rows include sampling and streaming."]
        if entry.get("http_error"):
            lines += ["", f"HTTP rows failed: {entry['http_error']}"]
        lines.append("")
    lines += ["Where the llama.cpp column says quoted, its figures are from shared/GPU.md (llama.cpp's CUDA build on the same "
              "kind of H200, random Llama-3.2-1B-shaped F16 GGUF with a 32k vocabulary, "
              "`llama-batched-bench -npp 512 -ntg 128`), not re-measured here; its 32k head "
              "reads 0.13 GB per step where the 128k one here reads 0.53 GB.", "",
              "## Machine", ""]
    machine = report.get("machine") or {}
    lines += [f"- {k}: {v}" for k, v in machine.items()]
    return "\n".join(lines) + "\n"


def kernel_markdown(kernels: dict[str, Any]) -> list[str]:
    if "error" in kernels:
        return [f"Failed: {kernels['error']}", "", "```", kernels.get("log_tail", ""), "```"]
    lines: list[str] = []
    cases = kernels.get("attention_cases") or []
    if cases:
        lines += ["| decode step on | KV buffer (capacity / held) | attention kernel | "
                  "step ms (wall, median) |", "| --- | --- | --- | ---: |"]
        for case in cases:
            lines.append(f"| {case['case']} | {case.get('kv_buffer', '-')} | "
                         f"{case.get('attention', '-')} | {case.get('step_ms', '-')} |")
        lines.append("")
    for busy in kernels.get("gpu_busy") or []:
        lines.append(f"- {busy['path']} N={busy['streams']}: wall {busy.get('wall_ms_per_step')}"
                     f" ms a step, GPU busy {busy.get('gpu_busy_ms_per_step')} ms "
                     f"({busy.get('kernels_per_step')} kernels a step); top: "
                     + ", ".join(f"{k['name'][:60]} {k['ms_per_step']} ms"
                                 for k in busy.get("top_kernels", [])[:5]))
    if kernels.get("note"):
        lines += ["", kernels["note"]]
    return lines
