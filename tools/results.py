#!/usr/bin/env python3
"""The benchmark results as data, and the README's results table rendered from them.

bench/results/<family>.csv holds one row a measured value (FIELDS below): a family per benchmark
(bench/bench_<family>.py, or an experiment of bench/experiments/); the .md files beside them are the
tables as committed, with their notes. Standard library only.

  tools/results.py                  print the README's results table
  tools/results.py --write          put it into README.md between the results markers
  tools/results.py --check          exit 1 where README.md's table is not the rendering (tests run this)
  tools/results.py show FAMILY [--commit C] [--op OP]   a family's rows (the latest run by default)
  tools/results.py add FAMILY OUT.md [--date D] [--commit C] [--device NAME] [--config C]
        append the tables of a benchmark's Markdown output (bench/out/bench_<family>.md) to
        bench/results/<family>.csv; the date, commit and device come from its `device: ...,
        date: ..., commit: ...` line where the options do not give them.
"""
from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# One row a measured value. implementation: headloss, a peer (liger, fla, cce, torch.compile, torch eager, ...) or
# floor (config says which: a copy of the same bytes, the three cuBLAS products, ...). metric: time_ms, time_us,
# gbps (bytes read + written a second, 1e9), peak_gib (device memory above the inputs), workspace_gib, workspace_mib,
# ratio_floor (the median over rounds of headloss's time over the floor's in the same round, where the bench
# pairs them).
# source: the committed .md file and section the value was read from.
FIELDS = ["date", "commit", "device", "op", "shape", "config", "implementation", "metric", "value", "source"]


# ---- reading a benchmark's Markdown tables --------------------------------------------------------------------

def number(cell: str):
    """The leading number of a cell ('2963 (98%)' -> 2963.0, '5.770 ms (762 TF/s)' -> 5.77); None if none."""
    m = re.match(r"\s*(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)", cell)
    return float(m.group(1)) if m else None


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str):
    """Each Markdown table of text: (the lines before it, its header cells, its rows of cells)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and lines[i].rstrip().endswith("|"):
            j = i
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            block = [ln for ln in lines[i:j] if not re.fullmatch(r"\s*\|[\s|:-]*\|\s*", ln)]
            if len(block) > 1:
                yield lines[:i], cells(block[0]), [cells(b) for b in block[1:]]
            i = j
        else:
            i += 1


def heading_before(before: list[str]) -> str:
    for ln in reversed(before):
        if ln.startswith("#"):
            return ln.lstrip("#").strip()
    return ""


def text_before(before: list[str]) -> str:
    """The paragraph just above a table."""
    out = []
    for ln in reversed(before):
        if not ln.strip():
            if out:
                break
            continue
        if ln.lstrip().startswith("|") or ln.startswith("#"):
            break
        out.append(ln)
    return " ".join(reversed(out))


def shape_of(cell: str) -> str:
    """'8192 x 128256' -> '8192x128256'; other labels as they are."""
    return re.sub(r"\s*x\s*", "x", cell) if re.fullmatch(r"\d+(\s*x\s*\d+)+", cell) else cell


# A family: the shape column(s), the columns that add to the config, and what each value column holds:
# header -> (implementation, config, metric[, op]); a header not listed is skipped (ratios, percentages, notes).
RMSNORM = {
    "shape": ["M x N"],
    "columns": {
        "headloss us": ("headloss", "", "time_us"),
        "headloss GB/s (% copy)": ("headloss", "", "gbps"),
        "same-bytes copy us (headloss %)": ("floor", "a copy of the same bytes", "time_us"),
        "headloss+rstd us": ("headloss", "rstd stored", "time_us"),
        "eager GB/s": ("torch eager", "", "gbps"),
        "F.rms_norm GB/s": ("F.rms_norm", "", "gbps"),
        "compile GB/s": ("torch.compile", "", "gbps"),
        "liger GB/s": ("liger", "", "gbps"),
        "forward us": ("headloss", "", "time_us", "fwd"),
        "fwd GB/s (% copy)": ("headloss", "", "gbps", "fwd"),
        "liger fwd GB/s": ("liger", "", "gbps", "fwd"),
        "backward us": ("headloss", "", "time_us", "bwd"),
        "bwd GB/s (% copy)": ("headloss", "", "gbps", "bwd"),
        "liger bwd GB/s": ("liger", "", "gbps", "bwd"),
    },
}
LOSS_ALL = "CE+z+H+GRPO+KL+metrics"
LOSS = {
    "shape": ["N x V"],
    "columns": {
        "copy floor": ("floor", "a copy of the logits", "time_ms"),
        "CE+grad": ("headloss", "CE", "time_ms"),
        "CE+z": ("headloss", "CE+z", "time_ms"),
        LOSS_ALL: ("headloss", LOSS_ALL, "time_ms"),
        "+ dual clip, CISPO, k2": ("headloss", LOSS_ALL + ", dual clip, CISPO, k2", "time_ms"),
        "+ MIS (seq)": ("headloss", LOSS_ALL + ", dual clip, CISPO, k2, MIS (seq)", "time_ms"),
        "+ GSPO (2 passes)": ("headloss", LOSS_ALL + ", dual clip, CISPO, k2, MIS (seq), GSPO", "time_ms"),
        "Liger CE+z": ("liger", "CE+z", "time_ms"),
        "torch.compile CE+z+H": ("torch.compile", "CE+z+H", "time_ms"),
        "eager CE+z+H": ("torch eager", "CE+z+H", "time_ms"),
        "torch.compile RL": ("torch.compile", "CE+z+H+GRPO+KL+3 metrics", "time_ms"),
        "torch.compile GSPO": ("torch.compile", "GSPO", "time_ms"),
        "Liger GRPO+KL": ("liger", "GRPO+KL", "time_ms"),
        "Liger GSPO+KL": ("liger", "GSPO+KL", "time_ms"),
    },
}
DISTILL = {
    "shape": ["N x V"],
    "columns": {
        "floor (2 reads + 1 write)": ("floor", "2 reads + 1 write", "time_ms"),
        "CE + fwd KL": ("headloss", "CE + fwd KL", "time_ms"),
        "CE + rev KL": ("headloss", "CE + rev KL", "time_ms"),
        "CE + JSD": ("headloss", "CE + JSD", "time_ms"),
        "CE + top-64 rev KL": ("headloss", "CE + top-64 rev KL", "time_ms"),
        "Liger JSD": ("liger", "JSD on log-probabilities", "time_ms"),
        "torch.compile CE + JSD": ("torch.compile", "CE + JSD", "time_ms"),
    },
}
LINEAR = {
    "shape": ["N x H x V"],
    "config": {"inputs": "{} inputs", "rows a chunk": "{} rows a chunk", "grad_weight": "{} grad_weight"},
    "columns": {
        "3 products (floor)": ("floor", "3 cuBLAS products", "time_ms"),
        "3 products": ("floor", "3 cuBLAS products", "time_ms"),
        "+ a copy of the logits": ("floor", "3 cuBLAS products + a copy of the logits", "time_ms"),
        "headloss CE": ("headloss", "CE", "time_ms"),
        "all terms + metrics": ("headloss", "all terms + metrics", "time_ms"),
        "all but entropy, + metrics": ("headloss", "all but entropy + metrics", "time_ms"),
        "CE, fp32 grad_weight": ("headloss", "CE, fp32 grad_weight", "time_ms"),
        "torch eager": ("torch eager", "CE", "time_ms"),
        "Liger FLCE": ("liger", "CE", "time_ms"),
        "CCE": ("cce", "CE", "time_ms"),
        "headloss workspace (GiB)": ("headloss", "CE", "workspace_gib"),
        "headloss: gradients + workspace (GiB)": ("floor", "gradients + workspace", "peak_gib"),
        "vs floor": ("headloss", "CE", "ratio_floor"),
        "ms": ("headloss", "CE", "time_ms"),
        "workspace (MiB)": ("headloss", "CE", "workspace_mib"),
    },
    # bench_linear_loss.py --memory-only: the peers' columns are peak memory there.
    "memory": {
        "headloss (torch_ops.linear_loss, 256 MiB workspace)":
            ("headloss", "CE, torch_ops.linear_loss, 256 MiB workspace", "peak_gib"),
        "torch eager": ("torch eager", "CE", "peak_gib"),
        "Liger FLCE": ("liger", "CE", "peak_gib"),
        "CCE": ("cce", "CE", "peak_gib"),
        "headloss's bound: grad_hidden + grad_weight + workspace":
            ("floor", "grad_hidden + grad_weight + workspace", "peak_gib"),
    },
}
LINEAR_PEERS = {"headloss": "headloss", "torch eager": "torch eager", "Liger FLCE": "liger", "CCE": "cce"}
GDN = {
    "shape": ["B, T, H, K=V", "B, T, H, K, V"],
    "columns": {
        "HBM floor ms": ("floor", "HBM: inputs read once, outputs written once", "time_ms"),
        "fla ms": ("fla", "", "time_ms"),
        "headloss ms": ("headloss", "", "time_ms"),
        "ours ms": ("headloss", "", "time_ms"),
        "Hopper kernel": ("headloss", "Hopper kernel", "time_ms"),
        "portable kernel": ("headloss", "portable kernel", "time_ms"),
    },
}
# Rows as implementations: the first cell -> (op suffix, implementation, config).
LOSS_TP_ROWS = {
    "unsharded, 1 GPU": ("", "headloss", "unsharded, 1 GPU"),
    "headloss: stats + all-gather + finish": ("", "headloss", "stats + all-gather + finish"),
    "stats alone": ("", "headloss", "stats alone"),
    "all-gather alone": ("", "headloss", "all-gather alone"),
    "finish alone": ("", "headloss", "finish alone"),
    "headloss: hl_loss_plan_execute_nccl": ("", "headloss", "hl_loss_plan_execute_nccl"),
    "PyTorch, an all-reduce per statistic": ("", "pytorch", "an all-reduce per statistic"),
    "Megatron-core vocab_parallel_cross_entropy": ("", "megatron-core", "vocab_parallel_cross_entropy"),
    "Megatron-core fused_vocab_parallel_cross_entropy": ("", "megatron-core", "fused_vocab_parallel_cross_entropy"),
    "headloss: the Megatron switch (per-token losses)": ("", "headloss", "the Megatron switch (per-token losses)"),
    "JSD unsharded, 1 GPU": ("_jsd", "headloss", "unsharded, 1 GPU"),
    "JSD: hl_loss_plan_execute_nccl": ("_jsd", "headloss", "hl_loss_plan_execute_nccl"),
    "linear unsharded, 1 GPU": ("_linear", "headloss", "unsharded, 1 GPU"),
    "linear floor: the shard's 3 products + all-reduce": ("_linear", "floor", "the shard's 3 products + all-reduce"),
    "linear: hl_loss_plan_execute_nccl": ("_linear", "headloss", "hl_loss_plan_execute_nccl"),
}
HF_ROWS = {
    "stock transformers": ("transformers", "stock"),
    "headloss: apply_headloss(model)": ("headloss", "apply_headloss(model)"),
    "headloss, uncapped workspace: max_workspace_bytes=None": ("headloss", "max_workspace_bytes=None"),
    "Liger, the same ops: RMSNorm + fused linear CE": ("liger", "the same ops: RMSNorm + fused linear CE"),
    "Liger, its default patch (+ RoPE, SwiGLU)": ("liger", "default patch, also RoPE and SwiGLU"),
}
FAMILIES = {"rmsnorm": RMSNORM, "loss": LOSS, "distill": DISTILL, "linear_loss": LINEAR, "gdn": GDN,
            "loss_tp": None, "hf_llama": None, "fused_gemms": None, "lt_algos": None}
OPS = {"rmsnorm": "rmsnorm", "loss": "loss", "distill": "distill", "linear_loss": "linear_loss",
       "gdn": "gdn_bwd_dqkwg", "loss_tp": "loss_tp", "hf_llama": "hf_llama_step"}


def rmsnorm_op(heading: str, override: str = "") -> str:
    d = override or ("bwd" if heading.lower().startswith("backward") else "fwd")
    residual = "residual" in heading or "s, dy, ds" in heading
    return f"rmsnorm_{d}" + ("_residual" if residual else "")


def rows_of(family: str, text: str, ctx: dict, config: str = "") -> list[dict]:
    """The CSV rows of the tables in text (one benchmark run's output); ctx: date, commit, device, source."""
    out = []

    def emit(op, shape, cfg, impl, metric, value):
        if value is not None:
            out.append(dict(ctx, op=op, shape=shape, config=cfg, implementation=impl, metric=metric,
                            value=f"{value:g}"))

    if family == "rmsnorm":
        m = re.search(r"copy bandwidth (\d+) GB/s", text)
        copy_gbps = float(m.group(1)) if m else None
        c = re.search(r"rmsnorm_fwd (\d+x\d+) bf16 from C[^:]*: ([\d.]+) us per call back-to-back", text)
        if c:
            emit("rmsnorm_fwd", c.group(1), "from C, back-to-back calls", "headloss", "time_us", float(c.group(2)))
    for before, head, body in tables(text):
        heading, para = heading_before(before), text_before(before)
        spec = FAMILIES.get(family)
        if family == "loss_tp":
            m = re.findall(r"\[(\d+), (\d+)\]", para)
            shape = "x".join(m[0]) if m else ""
            if "the weight's" in para:
                shape += "x" + re.search(r"the weight's (\d+) rows", para).group(1)
            if head[0] != "per rank":
                continue
            ce_alone = "beside Megatron-core" in para  # the CE table (CE+z+H before it had one)
            for r in body:
                if r[0] in LOSS_TP_ROWS:
                    suffix, impl, cfg = LOSS_TP_ROWS[r[0]]
                    base = "CE" if ce_alone else {"": "CE+z+H", "_jsd": "CE + JSD", "_linear": "CE"}[suffix]
                    emit("loss_tp" + suffix, shape, f"{base}; {cfg}", impl, "time_ms", number(r[1]))
            continue
        if family == "hf_llama":
            m = re.search(r"Llama with (\d+) layers, hidden (\d+), vocabulary (\d+)", text)
            n = re.search(r"(\d+ x \d+) tokens a step", text)
            shape = (f"Llama, {m.group(1)} layers, hidden {m.group(2)}, vocabulary {m.group(3)}"
                     + (f", {n.group(1)} tokens" if n else "")) if m else ""
            for r in body:
                if r[0] in HF_ROWS:
                    impl, cfg = HF_ROWS[r[0]]
                    emit("hf_llama_step", shape, cfg, impl, "time_ms", number(r[1]))
                    emit("hf_llama_step", shape, cfg, impl, "peak_gib", number(r[3]))
            continue
        if family == "fused_gemms":
            out += fused_gemms_rows(head, body, para, ctx)
            continue
        if family == "lt_algos":
            continue  # its tables sit in a code block: lt_algos_rows
        if head[0] not in spec["shape"]:
            continue
        columns = spec["columns"]
        if family == "linear_loss" and any(h.startswith("headloss (torch_ops") for h in head):
            columns = spec["memory"]
        table_cfg = [config] if config else []
        if "CUDA graphs" in para:
            table_cfg.append("CUDA graphs")
        for r in body:
            if len(r) != len(head):
                continue
            shape = shape_of(r[0])
            cfg_extra = list(table_cfg)
            for h, fmt in spec.get("config", {}).items():
                if h in head:
                    cfg_extra.append(fmt.format(r[head.index(h)]))
            for h, cell in zip(head[1:], r[1:]):
                if family == "linear_loss" and re.match(r"(peak )?memory: ", h):
                    names = [n.strip() for n in h.split(":", 1)[1].replace("(GiB)", "").split("/")]
                    for n, v in zip(names, cell.split("/")):
                        if n in LINEAR_PEERS:
                            emit("linear_loss", shape, "; ".join(["CE"] + cfg_extra), LINEAR_PEERS[n], "peak_gib",
                                 number(v))
                    continue
                if h not in columns:
                    continue
                impl, cfg, metric, *op = columns[h]
                full = "; ".join([x for x in [cfg] + cfg_extra if x])
                if family == "rmsnorm":
                    emit(rmsnorm_op(heading, op[0] if op else ""), shape, full, impl, metric, number(cell))
                else:
                    emit(OPS[family], shape, full, impl, metric, number(cell))
            if family == "rmsnorm" and copy_gbps and "headloss us" in head:
                emit(rmsnorm_op(heading), shape, "copy bandwidth, 2 GB buffers", "floor", "gbps", copy_gbps)
    return out


def fused_gemms_rows(head, body, para, ctx) -> list[dict]:
    """bench/experiments/fused_gemms.cu's tables: our products (experiment kernels, or the library's shifted
    forward) beside cuBLASLt's."""
    out = []

    def emit(shape, cfg, impl, value):
        if value is not None:
            out.append(dict(ctx, op="fused_gemms", shape=shape, config=cfg, implementation=impl, metric="time_ms",
                            value=f"{value:g}"))

    if head[:3] == ["product, M x N x K", "cuBLASLt", "ours"]:
        for r in body:
            if len(r) == len(head):
                label, _, shape = r[0].rpartition(", ")
                emit(shape, label, "cublaslt", number(r[1]))
                emit(shape, label, "fused_gemms.cu", number(r[2]))
    elif head[:3] == ["M x N x K", "cuBLAS logits", "ours"]:
        names = {"dX bf16 out": "dX = E W, bf16 out", "dX fp32 out": "dX = E W, fp32 out", "dW": "dW = E^T X"}
        for r in body:
            shape = shape_of(r[0])
            emit(shape, "logits", "cublaslt", number(r[1]))
            emit(shape, "shifted forward", "headloss", number(r[2]))
            for h, cell in zip(head, r):
                if h in names:
                    emit(shape, names[h], "cublaslt", number(cell))
    elif head[:2] == ["M x N x K", "cuBLAS logits"]:
        for r in body:
            shape = shape_of(r[0])
            emit(shape, "logits", "cublaslt", number(r[1]))
            for h, cell in zip(head[2:], r[2:]):
                emit(shape, f"shifted forward, tiles in groups of {h} row blocks", "headloss", number(cell))
    return out


def lt_algos_rows(text: str, ctx: dict) -> list[dict]:
    """bench/experiments/lt_algos.cu's listing: every answer of cuBLASLt's heuristic for a product."""
    out, shape = [], None
    for ln in text.split("\n"):
        m = re.match(r"(d[wx]) c=(\d+) V=(\d+) H=(\d+) \(m (\d+) n (\d+) k (\d+)\)", ln)
        if m:
            shape = f"{m.group(1)}: m {m.group(5)} n {m.group(6)} k {m.group(7)}"
            continue
        c = cells(ln) if ln.startswith("| ") else None
        if shape and c and c[0].isdigit() and len(c) == 11:
            cfg = f"answer {c[0]}, algo {c[1]}, tile {c[2]}, stages {c[3]}, split-k {c[4]}"
            for beta, cell in (("beta 0", c[7]), ("beta 1", c[9])):
                v = number(cell)
                if v:
                    out.append(dict(ctx, op="lt_algos", shape=shape, config=f"{cfg}; {beta}", implementation="cublaslt",
                                    metric="time_ms", value=f"{v:g}"))
    return out


def header_context(text: str) -> dict:
    m = re.search(r"device: ([^,]+), date: (\d{4}-\d\d-\d\d), commit: ([0-9a-f]{7,40})", text, flags=re.I)
    return dict(device=m.group(1), date=m.group(2), commit=m.group(3)) if m else {}


# ---- the data ---------------------------------------------------------------------------------------------------

def load(family: str) -> list[dict]:
    with open(RESULTS / f"{family}.csv", newline="") as f:
        return list(csv.DictReader(f))


def save(family: str, rows: list[dict], append: bool = False):
    path = RESULTS / f"{family}.csv"
    new = not (append and path.exists())
    with open(path, "a" if append else "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, lineterminator="\n")
        if new:
            w.writeheader()
        w.writerows(rows)


def latest(rows: list[dict], **match) -> list[dict]:
    """The rows matching every field given, of the latest date among them (the file's last run of that date)."""
    rows = [r for r in rows if all(r[k] == v for k, v in match.items())]
    if not rows:
        return []
    date = max(r["date"] for r in rows)
    last = [r for r in rows if r["date"] == date][-1]
    return [r for r in rows if r["date"] == date and r["commit"] == last["commit"] and r["source"] == last["source"]]


# ---- the README's table -----------------------------------------------------------------------------------------

# Each row: the op and shape as the README names them; where the data is (family, op, shape: None for any); headloss's
# config; the floor (config, label); the peers to take the best of (implementation, config, label). The first metric
# is the one compared; the run shown is the latest one that has headloss's row and, where peers are named, a peer.
FRONT = [
    dict(label="RMSNorm forward, 32768 x 4096, bf16", family="rmsnorm", op="rmsnorm_fwd", shape="32768x4096",
         ours="", floor=("a copy of the same bytes", "a copy of the same bytes"), metrics=["time_us", "gbps"],
         peers=[("liger", "", "Liger"), ("torch.compile", "", "torch.compile")]),
    dict(label="RMSNorm backward, 8192 x 16384, bf16", family="rmsnorm", op="rmsnorm_bwd", shape="8192x16384",
         ours="", floor=("a copy of the same bytes", "a copy of the same bytes"), metrics=["time_us", "gbps"],
         peers=[("liger", "", "Liger"), ("torch.compile", "", "torch.compile")]),
    dict(label="Loss: CE + z-loss with gradient, 8192 x 128256, bf16", family="loss", op="loss", shape="8192x128256",
         ours="CE+z", floor=("a copy of the logits", "a copy of the logits"), metrics=["time_ms"],
         peers=[("liger", "CE+z", "Liger CE + z"), ("torch.compile", "CE+z+H", "torch.compile CE + z + entropy")]),
    dict(label="Loss: every term and metric (CE, z, entropy, GRPO, KL to a reference), 8192 x 128256", family="loss",
         op="loss", shape="8192x128256", ours=LOSS_ALL, floor=("a copy of the logits", "a copy of the logits"),
         metrics=["time_ms"], peers=[("liger", "GRPO+KL", "Liger GRPO + KL alone"),
                                     ("torch.compile", "CE+z+H+GRPO+KL+3 metrics", "torch.compile, the same terms")]),
    dict(label="Loss: CE + dense JSD distillation, 8192 x 128256", family="distill", op="distill", shape="8192x128256",
         ours="CE + JSD", floor=("2 reads + 1 write", "the bytes (2 reads, 1 write)"), metrics=["time_ms"],
         peers=[("liger", "JSD on log-probabilities", "Liger JSD"), ("torch.compile", "CE + JSD", "torch.compile")]),
    dict(label="Fused linear + CE, forward + backward, 8192 x 4096 x 128256, bf16", family="linear_loss",
         op="linear_loss", shape="8192x4096x128256", ours="CE; random inputs",
         floor=("3 cuBLAS products; random inputs", "the 3 cuBLAS products"), metrics=["time_ms"],
         peers=[("torch eager", "CE; random inputs", "PyTorch eager"), ("liger", "CE; random inputs", "Liger FLCE"),
                ("cce", "CE; random inputs", "Cut Cross-Entropy")]),
    dict(label="Fused linear + CE through `torch_ops.linear_loss`: peak memory above the inputs, 16384 x 8192 x 151936",
         family="linear_loss", op="linear_loss", shape="16384x8192x151936",
         ours="CE, torch_ops.linear_loss, 256 MiB workspace",
         floor=("grad_hidden + grad_weight + workspace", "the gradients + 256 MiB"), metrics=["peak_gib"],
         peers=[("liger", "CE", "Liger FLCE"), ("cce", "CE", "Cut Cross-Entropy"),
                ("torch eager", "CE", "PyTorch eager")]),
    dict(label="gdn_bwd_dqkwg, B 8, T 4096, 16 heads, K = V = 128", family="gdn", op="gdn_bwd_dqkwg",
         shape="8, 4096, 16, 128", ours="", floor=("HBM: inputs read once, outputs written once", "HBM floor"),
         metrics=["time_ms"], peers=[("fla", "", "fla (Triton)")]),
    dict(label="gdn_bwd_dqkwg, Qwen3-Next: B 4, T 8192, 16 q/k heads, 32 value heads, 128", family="gdn",
         op="gdn_bwd_dqkwg", shape="Qwen3-Next GVA 2x: 4, 8192, 16 q/k heads, 32 value heads, 128", ours="",
         floor=("HBM: inputs read once, outputs written once", "HBM floor"), metrics=["time_ms"],
         peers=[("fla", "", "fla (Triton)")]),
    dict(label="Vocabulary-sharded CE, 8192 x 128256 in 2 shards, a rank", family="loss_tp",
         op="loss_tp", shape="8192x128256", ours="CE; stats + all-gather + finish", floor=None,
         metrics=["time_ms"], peers=[("megatron-core", "CE; fused_vocab_parallel_cross_entropy", "Megatron-core, fused"),
                                     ("megatron-core", "CE; vocab_parallel_cross_entropy", "Megatron-core")]),
    dict(label="Hugging Face Llama training step (4 layers, hidden 2048, vocabulary 128256, 16384 tokens)",
         family="hf_llama", op="hf_llama_step", shape=None, ours="apply_headloss(model)", floor=None,
         metrics=["time_ms", "peak_gib"],
         peers=[("liger", "the same ops: RMSNorm + fused linear CE", "Liger, the same ops"),
                ("liger", "default patch, also RoPE and SwiGLU", "Liger's default patch (also RoPE, SwiGLU)"),
                ("transformers", "stock", "stock transformers")]),
]


def fmt(metric: str, v: float) -> str:
    if metric == "gbps":
        return f"{v:.0f} GB/s"
    if metric == "time_us":
        return f"{v:.1f} us"
    if metric == "peak_gib":
        return f"{v:.2f} GiB"
    return f"{v:.3f} ms" if v < 10 else f"{v:.1f} ms" if v >= 100 else f"{v:.2f} ms"


def device_short(name: str) -> str:
    m = re.search(r"(\d+ x )?(?:NVIDIA )?(\w+)", name)
    return (m.group(1) or "") + m.group(2) if m else name


def value(rows, impl, config, metric):
    for r in rows:
        if r["implementation"] == impl and r["config"] == config and r["metric"] == metric:
            return float(r["value"])
    return None


def compare(ours: float, peer: float, metric: str) -> str:
    """How headloss stands against the peer's value."""
    if metric == "peak_gib":
        return f"headloss {ours / peer:.2f}x its memory"
    r = ours / peer if metric == "gbps" else peer / ours
    if abs(r - 1) < 0.005:
        return "level with headloss"
    return f"headloss {r:.2f}x faster" if r > 1 else f"headloss {1 / r:.2f}x slower"


def runs_newest_first(rows: list[dict]):
    """(date, commit, source) of each run, the newest first (a file's rows are in the order of the runs)."""
    seen = []
    for r in rows:
        k = (r["date"], r["commit"], r["source"])
        if k not in seen:
            seen.append(k)
    order = {k: i for i, k in enumerate(seen)}
    return sorted(seen, key=lambda k: (k[0], order[k]), reverse=True)


def front_row(spec) -> str:
    rows = [r for r in load(spec["family"]) if r["op"] == spec["op"]
            and (spec["shape"] is None or r["shape"] == spec["shape"])]
    for run in runs_newest_first(rows):
        same = [r for r in rows if (r["date"], r["commit"], r["source"]) == run]
        m0 = spec["metrics"][0]
        ours = {m: value(same, "headloss", spec["ours"], m) for m in spec["metrics"]}
        # a peer compares in the first of the metrics it was measured in (RMSNorm's peers: GB/s only)
        peers = [(label, impl, cfg, m, v) for impl, cfg, label in spec["peers"] for m in spec["metrics"][:1] + [
                 x for x in spec["metrics"][1:] if value(same, impl, cfg, m0) is None]
                 if (v := value(same, impl, cfg, m)) is not None]
        if ours[m0] is not None and (peers or not spec["peers"]):
            break
    else:
        raise SystemExit(f"tools/results.py: no data for '{spec['label']}'")
    cell = ", ".join(fmt(m, v) for m, v in ours.items() if v is not None)
    floor_cell = "-"
    if spec["floor"]:
        cfg, label = spec["floor"]
        floor = value(same, "floor", cfg, m0)
        if floor is not None:
            paired = value(same, "headloss", spec["ours"], "ratio_floor")
            notes = [f"{paired:.3f}x the floor, paired rounds" if paired else f"{ours[m0] / floor:.2f}x the floor"]
            bw = value(same, "floor", "copy bandwidth, 2 GB buffers", "gbps")
            if "gbps" in ours and bw:
                notes.insert(0, f"{100 * ours['gbps'] / bw:.0f}% of the copy bandwidth")
            cell += f" ({'; '.join(notes)})"
            floor_cell = f"{label}: {fmt(m0, floor)}"
    peer_cell = "-"
    if peers:
        m = peers[0][3]
        label, impl, cfg, m, v = (max if m == "gbps" else min)([p for p in peers if p[3] == m], key=lambda p: p[4])
        extra = [fmt(x, y) for x in spec["metrics"] if x != m and (y := value(same, impl, cfg, x)) is not None]
        peer_cell = f"{label}: {', '.join([fmt(m, v)] + extra)}; {compare(ours[m], v, m)}"
    r0 = same[0]
    where = f"{device_short(r0['device'])}, {r0['date']}, {r0['commit']}"
    return f"| {spec['label']} | {where} | {cell} | {floor_cell} | {peer_cell} |"


def render() -> str:
    out = ["| op, shape | device, date, commit | headloss | floor | best peer |", "|---|---|---|---|---|"]
    return "\n".join(out + [front_row(spec) for spec in FRONT]) + "\n"


def readme_table(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def show(family: str, commit: str | None, op: str | None) -> str:
    rows = load(family)
    if op:
        rows = [r for r in rows if r["op"] == op]
    if commit:
        rows = [r for r in rows if r["commit"] == commit]
    elif rows:
        rows = latest(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("show")
    s.add_argument("family")
    s.add_argument("--commit")
    s.add_argument("--op")
    a = sub.add_parser("add")
    a.add_argument("family", choices=sorted(FAMILIES))
    a.add_argument("markdown")
    for k in ("date", "commit", "device", "config"):
        a.add_argument(f"--{k}")
    args = ap.parse_args(argv)
    if args.cmd == "show":
        sys.stdout.write(show(args.family, args.commit, args.op))
        return 0
    if args.cmd == "add":
        text = Path(args.markdown).read_text()
        ctx = header_context(text)
        ctx.update({k: getattr(args, k) for k in ("date", "commit", "device") if getattr(args, k)})
        missing = [k for k in ("date", "commit", "device") if k not in ctx]
        if missing:
            raise SystemExit(f"{args.markdown} has no 'device: ..., date: ..., commit: ...' line: pass --"
                             + ", --".join(missing))
        ctx["source"] = Path(args.markdown).name
        rows = (lt_algos_rows(text, ctx) if args.family == "lt_algos"
                else rows_of(args.family, text, ctx, args.config or ""))
        save(args.family, rows, append=True)
        print(f"{len(rows)} rows appended to bench/results/{args.family}.csv")
        return 0
    table = render()
    if args.check:
        have = readme_table(README.read_text())
        if have != table:
            sys.stderr.write("README.md's results table is not the rendering of bench/results/*.csv; "
                             "run tools/results.py --write\n")
            return 1
        return 0
    if args.write:
        text = README.read_text()
        head, rest = text.split(BEGIN, 1)
        README.write_text(head + BEGIN + "\n" + table + rest[rest.index(END):])
        return 0
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
