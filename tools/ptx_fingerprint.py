"""The PTX fingerprint of every candidate config of the operator's forward kernel
(conv_tutorial/kernels/fprop.py; with --lesson05, lesson 05's own kernel at the candidates it runs:
those without a tail, row-block stores or split-K, which only the operator's copy has), compiled ahead of time for
sm_90 and sm_100 on a machine without a GPU: each PTX opcode's count, shared memory, registers,
stack frame and tensor-memory columns, and a hash of the PTX text itself (without its debug
information: line numbers and file paths), for the plain and the fused epilogue, plus a build with
a single k-step (a 1x1 layer of 64 channels: Triton passes k_steps == 1 as a constant).

    python tools/ptx_fingerprint.py out.json [--lesson05]    # then diff two of them (--compare a.json b.json)

A refactoring that must not change the kernel (moving code between files) compares the
fingerprints before and after.
"""
import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EPILOGUES = {"plain": [False, False, False, "none"], "fused": [True, True, True, "relu"]}


def _child(arch, kernel):
    sys.path.insert(0, str(ROOT))
    import common
    from conv_tutorial.configs import CANDIDATES
    from conv_tutorial.kernels import aot
    lesson05 = common.load_lesson("05-warp-specialized-conv") if kernel == "lesson05" else None
    build_of = lesson05.aot_conv2d_fprop if lesson05 else aot.fprop_build
    results = {}
    builds = [(f"{tuple(config)} {name}", dict(Ci=128 if config.split_k == 1 else 256, Co=256, config=config,
                                                 epilogue=epilogue))
              for config in CANDIDATES[arch] if lesson05 is None or lesson05.part_one_config(config)
              for name, epilogue in EPILOGUES.items()]
    builds.append(("one k-step", dict(Ci=64, Co=128, R=1, S=1, padding=0)))
    for label, build in builds:
        compiled = aot.compile_for_target(*build_of(arch, **build), arch)
        opcodes = Counter()
        for line in compiled.asm["ptx"].splitlines():
            line = re.sub(r"^@!?%\w+\s+", "", line.strip())
            match = re.match(r"([a-z][\w.:]*)\s", line)
            if match and not line.startswith(("//", ".")):
                opcodes[match.group(1)] += 1
        meta = compiled.metadata
        results[f"{arch} {label}"] = {
            "shared": meta.shared, "tmem": getattr(meta, "tmem_size", 0), "num_warps": meta.num_warps,
            **common.cubin_resources(compiled.asm.get("cubin")), "opcodes": dict(sorted(opcodes.items())),
            "ptx_text": ptx_text_hash(compiled.asm["ptx"])}
        print(f"{arch} {label}: shared {meta.shared}", file=sys.stderr, flush=True)
    print("FINGERPRINT:" + json.dumps(results))


def ptx_text_hash(ptx):
    """sha256 of the PTX without what only says where the source was: the debug sections, .loc
    and .file lines (the same kernel from another checkout, or with its lines moved, hashes the same)."""
    code = ptx.split(".section\t.debug")[0]
    lines = [line for line in code.splitlines() if not re.match(r"\s*(\.loc|\.file)\b", line)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def fingerprint(kernel="package"):
    everything = {}
    for arch in ("sm_90", "sm_100"):
        env = dict(os.environ, CONV_TUTORIAL_AOT="1", TRITON_INTERPRET="0")
        proc = subprocess.run([sys.executable, __file__, "--child", arch, kernel], env=env, capture_output=True,
                              text=True)
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
        # the fields both record (an older fingerprint may lack the PTX text's hash)
        changed = {field: (before[key][field], after[key][field]) for field in before[key].keys() & after[key].keys()
                   if before[key][field] != after[key][field]}
        if changed:
            lines.append(f"{key}: {changed}")
    return lines


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--compare":
        a, b = (json.loads(Path(p).read_text()) for p in sys.argv[2:4])
        differences = compare(a, b)
        print("\n".join(differences) or f"the same: {len(a)} builds, every opcode count, shared memory, "
                                          f"registers, stack, TMEM columns and (where both record it) the PTX text")
        sys.exit(1 if differences else 0)
    else:
        Path(sys.argv[1]).write_text(json.dumps(fingerprint("lesson05" if "--lesson05" in sys.argv else "package"),
                                                indent=1))
