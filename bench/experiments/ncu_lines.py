"""Where a kernel's time goes, by source line and function: ncu's per-instruction samples joined to the
lines of a local -lineinfo build of the same source (same nvcc: same SASS, which `nvdisasm -gi` maps to lines).
  on the device: ncu --set full --import-source no -k regex:NAME -c 1 -o p CMD
                 ncu --import p.ncu-rep --page source --csv --print-source sass > p.csv
  here:          nvcc ... -cubin -lineinfo FILE.cu -o k.cubin
                 python3 bench/experiments/ncu_lines.py k.cubin KERNEL_MANGLED_SUBSTRING p.csv FILE.cu [lines]
Each instruction counts for the innermost line of FILE it was inlined from (bench/notes/gdn.md "GDN v18")."""
import collections
import csv
import os
import re
import shutil
import subprocess
import sys

cubin, pattern, csv_file, source = sys.argv[1:5]
top = int(sys.argv[5]) if len(sys.argv) > 5 else 40
name = os.path.basename(source)
src = open(source).read().split("\n")
func, cur = [""] * (len(src) + 2), "?"
for i, line in enumerate(src, 1):  # the enclosing device function of each line (top-level definitions)
    m = re.match(r"^(?:\[\[maybe_unused\]\] )?(?:__device__|__global__)\b.*?(\w+)\s*\(", line)
    cur = m.group(1) if m else cur
    func[i] = cur

nvdisasm = shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"
sass = subprocess.run([nvdisasm, "-gi", "-c", cubin], capture_output=True, text=True, check=True).stdout
line_of, on, chain, in_group = {}, False, [], False
for text in sass.split("\n"):
    if ".section" in text and ".text." in text:
        on = pattern in text
        continue
    if not on:
        continue
    if "//##" in text:  # a group of these lines: innermost first, then where it was inlined
        chain = (chain if in_group else []) + re.findall(r'"([^"]*)", line (\d+)', text)
        in_group = True
        continue
    in_group = False
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", text)
    if m:
        ours = [int(n) for f, n in chain if os.path.basename(f) == name]
        line_of[int(m.group(1), 16)] = ours[0] if ours else 0

rows = list(csv.reader(open(csv_file)))
hdr = rows[1]
col = {h: i for i, h in enumerate(hdr)}
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
samples, executed = collections.Counter(), collections.Counter()
by_func = collections.defaultdict(collections.Counter)
base = None
for r in rows[2:]:
    try:
        addr = int(r[col["Address"]], 16)
    except (ValueError, IndexError):
        continue
    base = addr if base is None else base
    ln = line_of.get(addr - base, 0)
    s, e = float(r[col["Warp Stall Sampling (All Samples)"]] or 0), float(r[col["Instructions Executed"]] or 0)
    samples[ln] += s
    executed[ln] += e
    f = by_func[func[ln] if ln else "?"]
    f["samples"] += s
    f["executed"] += e
    for h in stalls:
        f[h] += float(r[col[h]] or 0)
ts, te = sum(samples.values()) or 1, sum(executed.values()) or 1
print(f"{len(line_of)} instructions mapped; {ts:.0f} samples, {te:.0f} warp instructions executed")
print("| function | samples | executed | top stalls (% of all samples) |\n|---|---|---|---|")
for f, c in sorted(by_func.items(), key=lambda kv: -kv[1]["samples"]):
    top_stalls = sorted(((c[h], h[6:]) for h in stalls), reverse=True)[:4]
    print(f"| {f} | {100 * c['samples'] / ts:.1f}% | {100 * c['executed'] / te:.1f}% | "
          + ", ".join(f"{h} {100 * v / ts:.1f}" for v, h in top_stalls) + " |")
print("\n| line | samples | executed | source |\n|---|---|---|---|")
for ln, s in samples.most_common(top):
    print(f"| {ln} | {100 * s / ts:.1f}% | {100 * executed[ln] / te:.1f}% | `{src[ln - 1].strip()[:90] if ln else ''}` |")
