# Start train_cuda/scripts/real_heads.py on the teacher in the background (about 9 minutes, 1500
# steps a head set); it outlives the call (setsid), later calls run beside it.
source benchmarks/gpu/gguf.sh
sed -i "s/^  steps: 1500/  steps: ${1:-1500}/" /tmp/rh/train_cuda/configs/real_heads.yaml
cd /tmp/rh
PYTHONPATH=/tmp/gsite setsid nohup python3 train_cuda/scripts/real_heads.py --base /tmp/smol.gguf --corpus /tmp/corpus \
  --out /tmp/heads > /tmp/heads.log 2>&1 < /dev/null &
sleep 30; tail -c 300 /tmp/heads.log
