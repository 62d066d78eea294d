"""The PTX fingerprint of every candidate config of lesson 05's kernel, compiled ahead of time for
sm_90 and sm_100 on a machine without a GPU: each PTX opcode's count, shared memory, registers,
stack frame and tensor-memory columns, for the plain and the fused epilogue.

    python tools/ptx_fingerprint.py out.json          # then diff two of them (--compare a.json b.json)

A refactoring that must not change the kernel (moving code between files) compares the
fingerprints before and after.
"""
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EPILOGUES = {"plain": [False, False, False, "none"], "fused": [True, True, True, "relu"]}


def _child(arch):
    sys.path.insert(0, str(ROOT))
    import common
    lesson05 = common.load_lesson("05-warp-specialized-conv")
    try:
        from conv_tutorial.configs import CANDIDATES
    except ImportError:             # the layout before the package
        from conv_runtime import CANDIDATES
    results = {}
    for config in CANDIDATES[arch]:
        for name, epilogue in EPILOGUES.items():
            Ci = 128 if config.split_k == 1 else 256
            kernel, args, kwargs = lesson05.aot_conv2d_fprop(arch, Ci=Ci, Co=256, config=config, epilogue=epilogue)
            compiled = common.compile_kernel_for_target(kernel, args, kwargs, arch)
            opcodes = Counter()
            for line in compiled.asm["ptx"].splitlines():
                line = re.sub(r"^@!?%\w+\s+", "", line.strip())
                match = re.match(r"([a-z][\w.:]*)\s", line)
                if match and not line.startswith(("//", ".")):
                    opcodes[match.group(1)] += 1
            meta = compiled.metadata
            results[f"{arch} {tuple(config)} {name}"] = {
                "shared": meta.shared, "tmem": getattr(meta, "tmem_size", 0), "num_warps": meta.num_warps,
                **common.cubin_resources(compiled.asm.get("cubin")), "opcodes": dict(sorted(opcodes.items()))}
            print(f"{arch} {config} {name}: shared {meta.shared}", file=sys.stderr, flush=True)
    print("FINGERPRINT:" + json.dumps(results))


def fingerprint():
    everything = {}
    for arch in ("sm_90", "sm_100"):
        env = dict(os.environ, CONV_TUTORIAL_AOT="1", TRITON_INTERPRET="0")
        proc = subprocess.run([sys.executable, __file__, "--child", arch], env=env, capture_output=True, text=True)
        found = [line for line in proc.stdout.splitlines() if line.startswith("FINGERPRINT:")]
        if not found:
            raise RuntimeError(f"{arch}: {proc.stderr[-3000:]}")
        everything.update(json.loads(found[0][len("FINGERPRINT:"):]))
    return everything


def compare(before, after):
    """Lines that say where two fingerprints differ; none when they agree."""
    lines = [f"only before: {key}" for key in before.keys() - after.keys()]
    lines += [f"only after: {key}" for key in after.keys() - before.keys()]
    for key in sorted(before.keys() & after.keys()):
        if before[key] != after[key]:
            changed = {field: (before[key].get(field), after[key].get(field)) for field in before[key]
                       if before[key].get(field) != after[key].get(field)}
            lines.append(f"{key}: {changed}")
    return lines


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        _child(sys.argv[2])
    elif sys.argv[1] == "--compare":
        a, b = (json.loads(Path(p).read_text()) for p in sys.argv[2:4])
        differences = compare(a, b)
        print("\n".join(differences) or f"the same: {len(a)} builds, every opcode count, shared memory, "
                                          f"registers, stack and TMEM columns")
        sys.exit(1 if differences else 0)
    else:
        Path(sys.argv[1]).write_text(json.dumps(fingerprint(), indent=1))
