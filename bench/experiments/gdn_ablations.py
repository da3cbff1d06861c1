"""Timing-only ablations of the Hopper GDN kernel's ODD path, written as sources for gdn_variant.sh:
  python3 bench/experiments/gdn_ablations.py DIR [NAME ...]   ->  DIR/NAME.cu for each (default: all)
  BUILD=/tmp/bd bench/experiments/gdn_variant.sh NAME DIR/NAME.cu; gdn_ab.py 5 '' .variants/tree.so .variants/NAME.so ...
Each ablation is a few text replacements in kernels/gdn/dqkwg_sm90.cu, each required to match exactly once (so one
that the kernel has outgrown fails here, not silently). Most give wrong results on purpose: they locate time
(bench/notes/gdn.md "GDN v21"); `cdense` is exact where K is a multiple of 8."""
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "kernels/gdn/dqkwg_sm90.cu"

NO_STATES = [("            hand_states<T, KH, VF>(P, h, hrow, vb, kb, 32 * pw + lane);\n", "")]
NO_V = [("            for (int x = 0; x < (P.dw_on ? 3 : 2); ++x)\n              hand_tile",
         "            for (int x = 0; x < 0; ++x)\n              hand_tile")]
# the consumers' dense code in every ODD kernel (the fence the hand copies need kept)
DENSE_CONSUMERS = [
    ("        if constexpr (ODD) {\n          if (P.hand || P.hand_v) fence_proxy_async();"
     "  // copied by hand (generic proxy), read by the wgmma\n        }",
     "        if (P.hand || P.hand_v) fence_proxy_async();"),
    *[(f"consume<T, KH, VF, {r}, ODD>(P, c)", f"consume<T, KH, VF, {r}, 0>(P, c)") for r in range(3)],
]

ABLATIONS = {
    "nostates": NO_STATES,  # h, dh not copied by hand
    "nov": NO_V,  # do, v, dv not copied by hand
    "nocopy": NO_STATES + NO_V,
    "nofence": [("          if (P.hand || P.hand_v) fence_proxy_async();"
                 "  // copied by hand (generic proxy), read by the wgmma\n", "")],
    "densestore": [("store_rows<T, KH, ODD>(out,", "store_rows<T, KH, 0>(out,"),
                   ("store_rows<T, KH, ODD>(static_cast", "store_rows<T, KH, 0>(static_cast")],
    "cdense": DENSE_CONSUMERS,
    "cdense_nocopy": DENSE_CONSUMERS + NO_STATES + NO_V,
    # the hand copies without their row bounds and safe-address selects (~2 instructions a copy fewer)
    "lean": [("      const bool in = col_in && r >= rlo && r < rhi;\n"
              "      cp_async_bytes<2 * W, true>(d + u * 128 + ((sw ^ u) << 4), in ? s + u * ld : safe, in);",
              "      (void)r, (void)safe;\n"
              "      cp_async_bytes<2 * W, true>(d + u * 128 + ((sw ^ u) << 4), s + u * ld, col_in);")],
    # every hand copy as one 16-byte copy that skips L1 by the first lane of its 16-byte chunk (from the address
    # rounded down: wrong data), the other lanes idle: what 16-byte copies of every row would cost
    "cg16": [("      cp_async_bytes<2 * W, true>(d + u * 128 + ((sw ^ u) << 4), in ? s + u * ld : safe, in);",
              "      if ((col & 7) == 0)\n"
              "        asm volatile(\"cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\" ::\n"
              "                     \"r\"(smem_addr(d + u * 128 + ((sw ^ u) << 4))),\n"
              "                     \"l\"(reinterpret_cast<uintptr_t>(in ? s + u * ld : safe) & ~uintptr_t(15)),"
              " \"r\"(in ? 16 : 0) : \"memory\");")],
}


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:] or ABLATIONS:
        text = SRC.read_text()
        for old, new in ABLATIONS[name]:
            if text.count(old) != 1:
                sys.exit(f"{name}: {old[:60]!r} matches {text.count(old)} times in {SRC.name}")
            text = text.replace(old, new)
        (out / f"{name}.cu").write_text(text)
        print(out / f"{name}.cu")


if __name__ == "__main__":
    main()
