#!/usr/bin/env bash
# Stages FlashInfer for the GPU machine (issue 48, bench/peer_flashinfer.py), whose calls can carry
# at most 64 MiB (the checkout, about 5 MiB, included) and which has no registry.
#
# What is staged (checked 2026-12 on PyPI; sizes in bytes):
#   flashinfer_python-0.7.4-py3-none-any.whl            101294319  sha256 a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32
#   apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
#                                                         3312304  sha256 059eed9bfc94bcd41650fb8eefde74040a1bc7e7b1a6f0a8ff897b02b118875b
#   (FI_VERSION=0.7.2.post1: flashinfer_python-0.7.2.post1-py3-none-any.whl, 62052965 bytes,
#    sha256 bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49)
# flashinfer-python is source only: its attention kernels are JIT-compiled at first use, with the
# machine's nvcc (CUDA 13.0 in the GPU image) and ninja. Of its other requirements the image lacks
# cuda-python (meta), cuda-tile, nccl-extensions, nccl4py, nvidia-cudnn-frontend and
# nvidia-cutlass-dsl(+libs); `import flashinfer` and the fa2 / fa3 decode and prefill paths import
# none of them (checked by importing 0.7.2.post1 and 0.7.4 with only apache-tvm-ffi added to the
# image's packages), so they are not staged. The zip of the wheel compresses badly (source files
# deflated one by one), so its files travel as one xz-compressed tar with the tvm-ffi wheel
# (0.7.4: 26649396 bytes, 25.4 MiB, for 100 MiB of wheels; about 3.5 minutes of one core here) that
# the device re-zips into the same wheel, after checking every file against the wheel's RECORD
# hashes, and installs with pip (checked here: the same files as pip installing the original).
#
# Here, at the root of the checkout that the device tool sends (the session's own checkout, not a
# helper's worktree; .peer/ is git-ignored, so the chunks travel only when a call's carry names them):
#   bash bench/stage_flashinfer.sh stage     # download, pack, split into .peer/flashinfer/c1 ... cN
#   bash bench/stage_flashinfer.sh verify    # optional: assemble and install here, as the device would
# It prints N and the calls. Each part is at most FI_CHUNK_MIB (default 55) MiB, so a call carrying
# one chunk folder stays under 64 MiB; with xz, 0.7.4 needs one chunk (N = 1).
#
# Device calls (the machine keeps /tmp while held, and is given back after 30 s idle: make them
# back to back; a call that finds parts missing says which chunk to carry next):
#   calls 1 .. N-1, carry [".peer/flashinfer/cK"]:
#     bash bench/stage_flashinfer.sh device .peer/flashinfer/cK
#   call N, carry [".peer/flashinfer/cN"] (installs into /tmp/fi-site once all parts are there,
#   then builds the JIT modules into /tmp/fi-ws; a later call on the same machine finds both done):
#     bash bench/stage_flashinfer.sh device .peer/flashinfer/cN || exit 1
#     export PYTHONPATH=/tmp/fi-site${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws
#     python3 bench/peer_flashinfer.py --mode both --compile-only
#   then, in the same call or the next (carrying cN again, so a fresh machine can redo the above),
#   beside the kvq benchmark and with the same exports:
#     python3 bench/peer_flashinfer.py | tee $OUT/peer_flashinfer.csv
#     python3 bench/peer_flashinfer.py --mode prefill | tee $OUT/peer_flashinfer_prefill.csv
# The JIT build time (5 modules by default: the CUDA-core decode for bf16 and fp8 caches, fa2's
# prefill kernel for bf16 and fp8 caches, which the _tc decode rows use too, and fa3's for bf16)
# has not been measured; --compile-only prints it per module.
# Environment: FI_DIR (default .peer/flashinfer), FI_VERSION (0.7.4), FI_TVM_FFI (0.1.15.post2),
# FI_CHUNK_MIB (55); on the device FI_STAGE (/tmp/fi-stage) and FI_SITE (/tmp/fi-site).
set -euo pipefail

FI_DIR=${FI_DIR:-.peer/flashinfer}
FI_VERSION=${FI_VERSION:-0.7.4}
FI_TVM_FFI=${FI_TVM_FFI:-0.1.15.post2}
FI_CHUNK_MIB=${FI_CHUNK_MIB:-55}
FI_STAGE=${FI_STAGE:-/tmp/fi-stage}
FI_SITE=${FI_SITE:-/tmp/fi-site}
PLATFORM_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

stage() {
  mkdir -p "$FI_DIR/wheels"
  rm -f "$FI_DIR"/wheels/*.whl
  python3 -m pip download -q --no-deps "${PLATFORM_ARGS[@]}" -d "$FI_DIR/wheels" \
    "flashinfer-python==$FI_VERSION" "apache-tvm-ffi==$FI_TVM_FFI"
  (cd "$FI_DIR/wheels" && sha256sum ./*.whl | sed 's| \./| |' > SHA256SUMS && ls -l ./*.whl && cat SHA256SUMS)
  rm -rf "$FI_DIR"/c[0-9]*
  python3 - "$FI_DIR" "$FI_CHUNK_MIB" <<'PY'
import base64, hashlib, io, lzma, os, sys, tarfile, zipfile
root, chunk_mib = sys.argv[1], int(sys.argv[2])
wheels = sorted(os.listdir(os.path.join(root, "wheels")))
fi = [w for w in wheels if w.startswith("flashinfer_python-") and w.endswith(".whl")]
assert len(fi) == 1, f"expected one flashinfer_python wheel, found {fi}"
payload = os.path.join(root, "payload.tar.xz")
with zipfile.ZipFile(os.path.join(root, "wheels", fi[0])) as z, \
        tarfile.open(payload, "w:xz", preset=9) as tar:
    names = z.namelist()
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    hashes = {}
    for line in z.read(record).decode().splitlines():
        path, h, _ = line.rsplit(",", 2)
        if h:
            hashes[path] = h
    def add(name, data):
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, 0
        tar.addfile(info, io.BytesIO(data))
    for n in names:  # the wheel's files in its order, each checked against RECORD
        data = z.read(n)
        if n in hashes:
            algo, digest = hashes[n].split("=", 1)
            got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
            assert got == digest, f"{n}: RECORD hash mismatch"
        add(f"{fi[0]}.tree/{n}", data)
    add(f"{fi[0]}.tree.order", "\n".join(names).encode())
    for w in wheels:  # the other wheels as they are, and the checksums of all
        if w != fi[0]:
            add(w, open(os.path.join(root, "wheels", w), "rb").read())
    print(f"checked {len(hashes)} files of {fi[0]} against its RECORD")
data = open(payload, "rb").read()
os.remove(payload)
step = chunk_mib << 20
parts = [data[i:i + step] for i in range(0, len(data), step)]
sums = open(os.path.join(root, "wheels", "SHA256SUMS")).read()
manifest = [f"payload payload.tar.xz {hashlib.sha256(data).hexdigest()} {len(data)}",
            f"wheel_tree {fi[0]}"]
manifest += [f"part payload.tar.xz.part{i + 1:02d} {hashlib.sha256(p).hexdigest()} {len(p)} c{i + 1}"
             for i, p in enumerate(parts)]
manifest += ["wheel " + line for line in sums.splitlines()]
for i, p in enumerate(parts):
    d = os.path.join(root, f"c{i + 1}")
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, f"payload.tar.xz.part{i + 1:02d}"), "wb").write(p)
    open(os.path.join(d, "MANIFEST"), "w").write("\n".join(manifest) + "\n")
print(f"payload {len(data)} bytes ({len(data) / 2**20:.1f} MiB) in {len(parts)} chunk(s) of at most {chunk_mib} MiB")
PY
  local n
  n=$(find "$FI_DIR" -maxdepth 1 -name 'c[0-9]*' -type d | wc -l)
  du -sh "$FI_DIR"/c[0-9]*
  echo "device calls: carry [\"$FI_DIR/cK\"] and run 'bash bench/stage_flashinfer.sh device $FI_DIR/cK' for K = 1 .. $n,"
  echo "back to back; the call with the last part installs into $FI_SITE (then export PYTHONPATH=$FI_SITE)."
}

# Collects the parts of the chunk folders given (default: every chunk folder this call carried),
# and, once all parts of the manifest are in FI_STAGE, assembles, checks and installs them.
device() {
  mkdir -p "$FI_STAGE"
  local dirs=("$@")
  [ ${#dirs[@]} -gt 0 ] || dirs=("$FI_DIR"/c[0-9]*)
  local d
  for d in "${dirs[@]}"; do
    [ -f "$d/MANIFEST" ] || { echo "stage_flashinfer: no MANIFEST in $d (was it carried?)" >&2; continue; }
    if [ -f "$FI_STAGE/MANIFEST" ] && ! cmp -s "$d/MANIFEST" "$FI_STAGE/MANIFEST"; then
      echo "stage_flashinfer: $d belongs to another staging than $FI_STAGE holds; starting over" >&2
      rm -rf "${FI_STAGE:?}"/*
    fi
    cp -f "$d"/MANIFEST "$d"/payload.tar.xz.part* "$FI_STAGE"/
  done
  [ -f "$FI_STAGE/MANIFEST" ] || { echo "stage_flashinfer: nothing staged in $FI_STAGE" >&2; return 2; }
  python3 - "$FI_STAGE" "$FI_SITE" "${FI_PIP_EXTRA:-}" <<'PY'
import base64, hashlib, os, shlex, shutil, subprocess, sys, tarfile, zipfile
stage, site, pip_extra = sys.argv[1], sys.argv[2], shlex.split(sys.argv[3])
lines = [l.split() for l in open(os.path.join(stage, "MANIFEST")) if l.strip()]
payload = next(l for l in lines if l[0] == "payload")
marker = os.path.join(site, ".fi-staged-" + payload[2][:16])
if os.path.exists(marker):
    print(f"stage_flashinfer: already installed in {site}")
    sys.exit(0)
parts = [l for l in lines if l[0] == "part"]
missing = []
for _, name, sha, size, chunk in parts:
    p = os.path.join(stage, name)
    if not os.path.exists(p) or os.path.getsize(p) != int(size) or \
            hashlib.sha256(open(p, "rb").read()).hexdigest() != sha:
        missing.append(chunk)
if missing:
    print(f"stage_flashinfer: {len(parts) - len(missing)} of {len(parts)} parts here; carry next: {', '.join(missing)}")
    sys.exit(3)
data = b"".join(open(os.path.join(stage, l[1]), "rb").read() for l in parts)
assert hashlib.sha256(data).hexdigest() == payload[2], "payload checksum mismatch"
out = os.path.join(stage, "x")
shutil.rmtree(out, ignore_errors=True)
os.makedirs(out)
tar_path = os.path.join(stage, "payload.tar.xz")
open(tar_path, "wb").write(data)
del data
with tarfile.open(tar_path, "r:xz") as tar:
    tar.extractall(out, filter="data")
os.remove(tar_path)
wheel = next(l[1] for l in lines if l[0] == "wheel_tree")
tree = os.path.join(out, wheel + ".tree")
names = open(tree + ".order").read().split("\n")
record = next(n for n in names if n.endswith(".dist-info/RECORD"))
checked = 0
for line in open(os.path.join(tree, record)).read().splitlines():
    path, h, _ = line.rsplit(",", 2)
    if h:
        algo, digest = h.split("=", 1)
        got = base64.urlsafe_b64encode(hashlib.new(algo, open(os.path.join(tree, path), "rb").read()).digest())
        assert got.rstrip(b"=").decode() == digest, f"{path}: RECORD hash mismatch"
        checked += 1
with zipfile.ZipFile(os.path.join(out, wheel), "w", zipfile.ZIP_STORED) as z:
    for n in names:  # stored, not deflated: pip only unpacks it
        z.writestr(zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0)), open(os.path.join(tree, n), "rb").read())
shutil.rmtree(tree)
os.remove(tree + ".order")
sums = {l[2]: l[1] for l in lines if l[0] == "wheel"}
for w, sha in sums.items():
    if w != wheel:
        assert hashlib.sha256(open(os.path.join(out, w), "rb").read()).hexdigest() == sha, f"{w}: checksum mismatch"
print(f"stage_flashinfer: payload ok, {checked} files of {wheel} match its RECORD; installing {len(sums)} wheels into {site}")
wheels = [os.path.join(out, w) for w in sorted(sums)]
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--upgrade", "--target", site, *pip_extra, *wheels], check=True)
shutil.rmtree(out)
open(marker, "w").write("\n".join(sums) + "\n")
print(f"stage_flashinfer: installed; export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}}")
PY
}

# Here: the device's assembly and install into a scratch folder (pip told the device's Python).
verify() {
  local tmp
  tmp=$(mktemp -d)
  FI_STAGE=$tmp/stage FI_SITE=$tmp/site FI_PIP_EXTRA="--only-binary=:all: --python-version 3.12 --implementation cp \
--platform manylinux_2_28_x86_64" device
  ls "$tmp/site"
  rm -rf "$tmp"
}

case ${1:-} in
  stage) stage ;;
  device) shift; device "$@" ;;
  verify) verify ;;
  -h|--help|help) usage 0 ;;
  *) usage 2 ;;
esac
