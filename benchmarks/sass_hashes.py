"""A hash of each kernel's SASS, to tell which builds a source edit changed, a development tool.

    python benchmarks/sass_hashes.py ARCH SOURCE_FILE OUT [--nvdisasm PATH]

Compiles every instantiation of SOURCE_FILE (e.g. flash_bwd_tc.cu) for ARCH (sm_80, sm_90a) with
NVRTC, no GPU needed, disassembles each cubin with nvdisasm (the nvidia-cuda-nvdisasm wheel has
one) and writes "hash instructions tma name_expression" per kernel. Two trees' files, diffed by
name, say which builds' machine code an edit moved: those are the ones a GPU run must cover.
"""

import argparse
import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile


def kernels(arch: str, source_file: str) -> list:
    from cupyflash import _instantiations

    return [k for k in _instantiations.all_kernels(arch) if k.source_file == source_file]


def sass_hash(job) -> tuple:
    arch, source_file, index, nvdisasm = job
    from cupy_backends.cuda.libs import nvrtc

    from cupyflash import _compile

    kernel = kernels(arch, source_file)[index]
    prog = nvrtc.createProgram(_compile._source_for([kernel]), kernel.source_file, [], [])
    try:
        nvrtc.addNameExpression(prog, kernel.name_expression)
        nvrtc.compileProgram(prog, [*_compile.COMPILE_OPTIONS, "-ftz=true", f"--gpu-architecture={arch}"])
        cubin = nvrtc.getCUBIN(prog) + b"\0"  # getCUBIN drops the trailing NUL (../shared/CUPY.md)
    finally:
        nvrtc.destroyProgram(prog)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
    try:
        text = subprocess.run([nvdisasm, "-c", fh.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(fh.name)
    # Instructions only: the address comments and encodings go.
    lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in text.splitlines()
             if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]
    return digest, len(lines), int(getattr(kernel, "tma", False)), kernel.name_expression


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("arch")
    ap.add_argument("source_file")
    ap.add_argument("out")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    args = ap.parse_args(argv)
    if not args.nvdisasm:
        raise SystemExit("no nvdisasm on PATH: pass --nvdisasm (pip download nvidia-cuda-nvdisasm, unzip)")
    jobs = [(args.arch, args.source_file, i, args.nvdisasm) for i in range(len(kernels(args.arch, args.source_file)))]
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count()) as pool, open(args.out, "w") as fh:
        for digest, count, tma, name in pool.map(sass_hash, jobs):
            fh.write(f"{digest} {count} {tma} {name}\n")
    print(f"{len(jobs)} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
