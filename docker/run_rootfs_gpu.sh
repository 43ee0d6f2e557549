#!/usr/bin/env bash
# On the GPU machine (root, no container runtime): runs the runtime-cuda image's root filesystem
# (docker/export_rootfs.sh) the way the NVIDIA container toolkit would run the image: a private
# mount namespace, /dev and /proc inside, the host driver's libcuda.so.1 bind-mounted over the
# image's path for it, the server as uid 10001 with --gpu=on, and the image's CLI driving the
# client workload (create, append 32k tokens, decode with every method). Logs under $OUT.
#   carry [".carry/cimg"]; then: bash docker/run_rootfs_gpu.sh
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/cimg
tar -xJf .carry/cimg/rootfs.tar.xz -C /tmp/cimg
R=/tmp/cimg/rootfs
L=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
echo "driver library: $L"
cat > /tmp/cimg/inside.sh <<INNER
set -euo pipefail
mount --rbind /dev $R/dev
mount -t proc proc $R/proc
touch $R/usr/lib/x86_64-linux-gnu/libcuda.so.1
mount --bind $L $R/usr/lib/x86_64-linux-gnu/libcuda.so.1
as_user() { chroot --userspec=10001:10001 $R "\$@"; }
chroot --userspec=10001:10001 $R /usr/local/bin/kvsparse-server --listen=127.0.0.1:50071 \
  --metrics_listen=127.0.0.1:9481 --gpu=on --capacity=8G > $OUT/server.log 2>&1 &
server=\$!
cli="/usr/local/bin/kvsparse --target=127.0.0.1:50071"
as_user \$cli --wait_for_ready=20s health
as_user \$cli create --seq=demo --layers=4 --k_tier=device --signature_bits=32
as_user \$cli append --seq=demo --tokens=32768 --seed=7
for m in dense santa hash_top_k vattention; do
  echo "== \$m"
  as_user \$cli decode --seq=demo --layer=2 --method=\$m
done
kill -TERM \$server
wait \$server
INNER
unshare -m bash /tmp/cimg/inside.sh
grep -E "decode engine|shut down" "$OUT/server.log"
