# bash benchmarks/gpu/stash.sh DIR: keep DIR's GGUF part on the machine for the heads call
mkdir -p /tmp/stash && cp "$1"/gg_* /tmp/stash/ && ls -la /tmp/stash
