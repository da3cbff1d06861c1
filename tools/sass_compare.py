#!/usr/bin/env python3
"""Did a refactor move any device code? Compares two builds of the library kernel by kernel.

For each architecture in the fatbins and each function (kernel instantiation, and any device
function ptxas kept out of line) it compares:
  - the SASS: every instruction and its encoding (cuobjdump -sass), addresses dropped, symbol names
    normalised (below); with --no-encoding, the instruction text alone;
  - the resources (cuobjdump -res-usage: registers, stack, shared, local and constant memory);
  - with --ptx, the PTX embedded for the GPUs that compile it at load, per source file (line
    information, comments and symbol names aside);
  - with --ptxas-before/--ptxas-after, the ptxas -v report of the two builds' logs (stack frame,
    spill stores and loads, registers, barriers, shared and constant memory), e.g. the stderr of
      cmake -S . -B build-x -DHL_PTXAS_VERBOSE=ON -DCMAKE_CUDA_ARCHITECTURES="90a-real;80" ...
      cmake --build build-x -j2 -- -Otarget 2> ptxas-x.log
    (-Otarget, GNU make: each unit's report in one piece; a log whose reports interleave is refused).

Names are demangled (c++filt) and stripped of every namespace and class qualifier, and of the
per-file hashes nvcc gives anonymous namespaces and internal symbols, so that renamed namespaces and
moved files still pair each kernel with itself. Functions whose normalised names coincide are
compared as a multiset.

BEFORE and AFTER are each a library (libheadloss.so*), an object file, or a build directory (every
*.o under it). A checkout's build writes its library to lib/, so keep a copy of the first one, or
point at the build directories' objects.

Exit status: 0 when everything compared is identical, 1 otherwise (the report says what differs).

cuobjdump ships with the CUDA toolkit; where it is missing, `pip install nvidia-cuda-cuobjdump` has it
(its bin/ under site-packages/nvidia/cu13/); --cuobjdump names it. Example (a few minutes on 2 cores;
the SASS of the whole library is about 1 GB of text, streamed):
  tools/sass_compare.py build-before build-after --ptxas-before before.log --ptxas-after after.log
"""
import argparse
import collections
import hashlib
import os
import re
import shutil
import subprocess
import sys

ANON = re.compile(r"\(anonymous namespace\)::")
QUAL = re.compile(r"\b[A-Za-z_][A-Za-z_0-9]*(?:<[^<>]*>)?::")
INTERNAL = re.compile(r"\b_INTERNAL_[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}::")


def find_tool(name, given):
    if given:
        return given
    path = shutil.which(name)
    if path:
        return path
    for root in sys.path:  # the pip wheel's binary
        cand = os.path.join(root, "nvidia", "cu13", "bin", name)
        if os.path.isfile(cand):
            return cand
    sys.exit(f"{name} not found: install the CUDA toolkit or `pip install nvidia-cuda-{name}`, or pass --{name}")


class Names:
    """Mangled name -> normalised name, demangling in batches through c++filt."""

    def __init__(self):
        self.cache = {}

    def add(self, names):
        todo = sorted({n for n in names if n not in self.cache})
        if not todo:
            return
        out = subprocess.run(["c++filt"], input="\n".join(todo) + "\n", capture_output=True, text=True,
                             check=True).stdout.splitlines()
        for mangled, dem in zip(todo, out):
            self.cache[mangled] = normalise(dem)

    def __getitem__(self, name):
        if name not in self.cache:
            self.add([name])
        return self.cache[name]


def normalise(demangled):
    s = INTERNAL.sub("", demangled)
    s = ANON.sub("", s)
    prev = None
    while prev != s:  # innermost qualifiers first, templates' own qualifiers with them
        prev = s
        s = QUAL.sub("", s)
    return s


def inputs(path):
    if os.path.isdir(path):
        objs = []
        for root, _, files in os.walk(path):
            objs += [os.path.join(root, f) for f in files if f.endswith(".o")]
        if not objs:
            sys.exit(f"{path}: no object files")
        return sorted(objs)
    return [path]


SYM = re.compile(r"`\(([^)]*)\)")


def sass(cuobjdump, files, names, encoding, keep=None):
    """{(arch, normalised name): [(digest, instructions, source)]}; keep: names whose normalised
    instructions to return too (else None)."""
    funcs = collections.defaultdict(list)
    for f in files:
        proc = subprocess.Popen([cuobjdump, "-sass", f], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, bufsize=1 << 20)
        arch = source = name = None
        h = count = body = None

        def close():
            if name is not None:
                funcs[(arch, names[name])].append((h.hexdigest(), count, body, source))

        for line in proc.stdout:
            s = line.strip()
            if s.startswith("/*") and "*/" in s:
                head, _, rest = s.partition("*/")
                if head[2:].strip().isalnum() and not head.startswith("/* 0x"):  # /*0120*/ INSTR ; /* 0x.. */
                    instr, _, enc = rest.partition("/*")
                    instr = SYM.sub(lambda m: "`(" + names[m.group(1)] + ")", instr.strip())
                    text = instr + (" " + enc.strip(" */") if encoding else "")
                else:  # the second word of the encoding
                    if not encoding:
                        continue
                    text = "  " + s.strip("/* ")
                h.update(text.encode() + b"\n")
                count += 1
                if body is not None:
                    body.append(text)
            elif s.startswith("Function : "):
                close()
                name = s[len("Function : "):]
                h, count = hashlib.sha256(), 0
                body = [] if keep is not None and names[name] in keep else None
            elif s.startswith("arch = "):
                close()
                name, arch = None, s[len("arch = "):]
            elif s.startswith("identifier = "):
                source = os.path.basename(s[len("identifier = "):])
        close()
        proc.wait()
    return funcs


MANGLED = re.compile(r"\b_Z[\w$]*")


def ptx(cuobjdump, files):
    """{(arch, source file): [digest]} of the embedded PTX (what a newer GPU compiles at load), each
    module without its line information (.loc, .file, debug sections) and comments, its symbols
    renamed by first appearance."""
    out = collections.defaultdict(list)

    def close(key, lines):
        if key is None:
            return
        ids = {}
        text = MANGLED.sub(lambda m: ids.setdefault(m.group(0), f"_sym{len(ids)}"), "\n".join(lines))
        out[key].append(hashlib.sha256(text.encode()).hexdigest())

    for f in files:
        text = subprocess.run([cuobjdump, "-ptx", f], capture_output=True, text=True).stdout
        key, lines, arch, in_ptx, debug = None, [], None, False, False
        for line in text.splitlines():
            s = line.strip()
            if debug or (s.startswith(".section") and ".debug" in s):  # line information's names
                debug = s != "}"
                continue
            if s.startswith("Fatbin "):
                close(key, lines)
                key, lines, in_ptx = None, [], s.startswith("Fatbin ptx")
            elif s.startswith("arch = "):
                arch = s[len("arch = "):]
            elif s.startswith("identifier = ") and in_ptx:
                key = (arch, os.path.basename(s[len("identifier = "):]))
            elif in_ptx and key and s and not s.startswith((".loc", ".file", "//", "ptxasOptions")):
                lines.append(s)
        close(key, lines)
    return out


def res_usage(cuobjdump, files, names):
    """{(arch, normalised name): [resource string]} from cuobjdump -res-usage."""
    out = collections.defaultdict(list)
    for f in files:
        text = subprocess.run([cuobjdump, "-res-usage", f], capture_output=True, text=True).stdout
        arch = None
        lines = text.splitlines()
        for i, line in enumerate(lines):
            m = re.search(r"arch = (\S+)", line)
            if m:
                arch = m.group(1)
            m = re.match(r"\s*Function (\S+):\s*$", line)
            if m and i + 1 < len(lines):
                out[(arch, names[m.group(1)])].append(lines[i + 1].strip())
    return out


def ptxas_log(path, names):
    """{(arch, normalised name): [report]} from a build's ptxas -v output."""
    out = collections.defaultdict(list)
    entry = arch = pending = None
    props = {}
    lines = open(path, errors="replace").read().splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"Compiling entry function '([^']+)' for '([^']+)'", line)
        if m:
            entry, arch = m.group(1), m.group(2)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            pending = m.group(1)
            continue
        m = re.match(r"\s*(\d+ bytes stack frame.*)", line)
        if m:
            if pending is None:
                sys.exit(f"{path}:{i + 1}: a stack frame line without its function: interleaved (build with -Otarget)")
            if pending == entry:
                props[pending] = m.group(1)
            else:  # a device function kept out of line: no "Used" line follows
                out[(arch, names[pending])].append("(function) " + m.group(1))
            pending = None
            continue
        m = re.search(r"ptxas info\s*: (Used .*)", line)
        if m:
            if entry is None or entry not in props:
                sys.exit(f"{path}:{i + 1}: a report without its entry function: interleaved (build with -Otarget)")
            out[(arch, names[entry])].append(props.pop(entry) + "; " + m.group(1))
            entry = None
    return out


def compare(title, before, after, show=10, noun="functions"):
    """Prints the comparison of two {key: [values]} maps; returns whether they are identical."""
    keys = sorted(set(before) | set(after))
    same = diff = gone = new = 0
    lines = []
    for k in keys:
        b, a = sorted(before.get(k, [])), sorted(after.get(k, []))
        if b == a:
            same += 1
        elif not a:
            gone += 1
            lines.append(f"  only before: {k[0]} {k[1]}")
        elif not b:
            new += 1
            lines.append(f"  only after:  {k[0]} {k[1]}")
        else:
            diff += 1
            lines.append(f"  differs:     {k[0]} {k[1]}")
    archs = collections.Counter(k[0] for k in keys)
    print(f"{title}: {len(keys)} {noun} ({', '.join(f'{n} {a}' for a, n in sorted(archs.items()))}): "
          f"{same} identical, {diff} differ, {gone} only before, {new} only after")
    for l in lines[:show]:
        print(l)
    if len(lines) > show:
        print(f"  ... and {len(lines) - show} more (--show N)")
    return not lines


def first_difference(b, a):
    for i, (x, y) in enumerate(zip(b, a)):
        if x != y:
            return f"SASS line {i}: before `{x}`, after `{y}`"
    return f"lengths {len(b)} and {len(a)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--ptxas-before", help="the first build's ptxas -v log")
    ap.add_argument("--ptxas-after", help="the second build's ptxas -v log")
    ap.add_argument("--no-encoding", action="store_true", help="compare instruction text only")
    ap.add_argument("--no-sass", action="store_true", help="resources and ptxas reports only")
    ap.add_argument("--ptx", action="store_true",
                    help="also the embedded PTX, module by module (line information and symbol names aside)")
    ap.add_argument("--show", type=int, default=10, help="differences listed per comparison")
    ap.add_argument("--cuobjdump", help="the cuobjdump binary")
    args = ap.parse_args()
    cuobjdump = find_tool("cuobjdump", args.cuobjdump)
    names = Names()
    fb, fa = inputs(args.before), inputs(args.after)
    ok = True
    if args.ptxas_before or args.ptxas_after:
        if not (args.ptxas_before and args.ptxas_after):
            sys.exit("--ptxas-before and --ptxas-after go together")
        ok &= compare("ptxas -v reports", ptxas_log(args.ptxas_before, names), ptxas_log(args.ptxas_after, names),
                      args.show)
    ok &= compare("resource usage (cuobjdump -res-usage)", res_usage(cuobjdump, fb, names),
                  res_usage(cuobjdump, fa, names), args.show)
    if args.ptx:
        ok &= compare("PTX", ptx(cuobjdump, fb), ptx(cuobjdump, fa), args.show, "modules")
    if not args.no_sass:
        enc = not args.no_encoding
        sb, sa = sass(cuobjdump, fb, names, enc), sass(cuobjdump, fa, names, enc)
        digest = lambda m: {k: [(d, n) for d, n, _, _ in v] for k, v in m.items()}
        same = compare("SASS" + (" (instructions and encodings)" if enc else " (instructions)"), digest(sb),
                       digest(sa), args.show)
        ok &= same
        if not same:  # the first difference of each function that differs (a second pass over those)
            keep = {k[1] for k in set(sb) & set(sa) if sorted(digest(sb)[k]) != sorted(digest(sa)[k])}
            keep = set(sorted(keep)[: args.show])
            if keep:
                bb, aa = sass(cuobjdump, fb, names, enc, keep), sass(cuobjdump, fa, names, enc, keep)
                for k in sorted(set(bb) & set(aa)):
                    if k[1] in keep and sorted(x[0] for x in bb[k]) != sorted(x[0] for x in aa[k]):
                        b, a = bb[k][0], aa[k][0]
                        print(f"  {k[0]} {k[1]} ({b[3]} -> {a[3]}): {first_difference(b[2], a[2])}")
    print("identical" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
