"""A hash of each kernel build's machine code (SASS), to tell which builds a source edit changed.

    python tools/sass_hashes.py OUT [--arch sm_80 --arch sm_90a] [--source sm90/fwd.cu ...] [--dtype float64 ...]
                                    [--jobs N]

Compiles every instantiation (or those of the given sources) with NVRTC for each architecture, no
GPU needed (runtime.compiler.compile_cubin), disassembles each cubin with nvdisasm (the
nvidia-cuda-nvdisasm wheel has one; --nvdisasm PATH) and writes "arch hash instructions
name_expression" per build. Two trees' files, diffed by name, say which builds' machine code an
edit moved: those are the ones a GPU run must cover. Only instructions are hashed (addresses and
encodings dropped, and the symbols that branches and returns name replaced), so a kernel renamed
without another change hashes the same.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_SYMBOL = re.compile(r"`\([^)]*\)")  # e.g. RET.REL.NODEC R10 `(_ZN9cupyflash...kernel...)


def _builds(archs, sources, dtypes) -> list[tuple[str, int]]:
    from cupyflash import catalog

    return [(arch, i) for arch in archs for i, k in enumerate(catalog.all_kernels(arch))
            if (not sources or k.source_file in sources) and (not dtypes or k.dtype_name in dtypes)]


def _hash(job) -> str:
    arch, index, nvdisasm = job
    from cupyflash import catalog
    from cupyflash.runtime import compiler

    kernel = catalog.all_kernels(arch)[index]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(compiler.compile_cubin(kernel, arch))
    try:
        text = subprocess.run([nvdisasm, "-c", fh.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(fh.name)
    lines = [_SYMBOL.sub("`(symbol)", _ADDRESS.sub("", line)).strip()
             for line in text.splitlines() if _ADDRESS.search(line)]
    digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()[:16]
    return f"{arch} {digest} {len(lines)} {kernel.name_expression}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--arch", action="append", help="default: sm_80 and sm_90a")
    ap.add_argument("--source", action="append", help="only these kernel sources (relative to kernels/)")
    ap.add_argument("--dtype", action="append", help="only these dtypes' builds (e.g. float64)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    args = ap.parse_args(argv)
    if not args.nvdisasm:
        raise SystemExit("no nvdisasm on PATH: pass --nvdisasm (pip download nvidia-cuda-nvdisasm, unzip it)")
    jobs = [(arch, i, args.nvdisasm) for arch, i in _builds(args.arch or ["sm_80", "sm_90a"], args.source, args.dtype)]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool, open(args.out, "w") as fh:
        for n, line in enumerate(pool.map(_hash, jobs, chunksize=4), 1):
            fh.write(line + "\n")
            if n % 100 == 0:
                print(f"{n} of {len(jobs)} builds", file=sys.stderr, flush=True)
    print(f"{len(jobs)} builds -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
