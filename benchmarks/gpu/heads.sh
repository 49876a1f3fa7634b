# Assemble the GGUF and start train_cuda/scripts/real_heads.py in the background (about 9 minutes,
# 1500 steps a head set); it outlives the call (setsid), later calls run beside it.
set -e
cat /tmp/stash/gg_aa /tmp/stash/gg_ab .gpu/g3/gg_ac > /tmp/smol.gguf
echo "$(cat .gpu/g3/gguf.sha)  /tmp/smol.gguf" | sha256sum -c
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gsite .gpu/g3/gguf-*.whl
rm -rf /tmp/rh /tmp/corpus; mkdir -p /tmp/rh/benchmarks
cp -r train_cuda /tmp/rh/; cp benchmarks/chat_prompts.txt /tmp/rh/benchmarks/; cp -r .gpu/g3/corpus /tmp/corpus
sed -i "s/^  steps: 1500/  steps: ${1:-1500}/" /tmp/rh/train_cuda/configs/real_heads.yaml
cd /tmp/rh
PYTHONPATH=/tmp/gsite setsid nohup python3 train_cuda/scripts/real_heads.py --base /tmp/smol.gguf --corpus /tmp/corpus \
  --out /tmp/heads > /tmp/heads.log 2>&1 < /dev/null &
sleep 30; tail -c 300 /tmp/heads.log
