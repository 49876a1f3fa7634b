# Start the hybrid target's run in the background: train_cuda/scripts/real_default.py with
# configs/real_hybrid_target.yaml (a full-size 50% Mamba2 hybrid of the teacher and its ReDrafter
# drafter, about 13 minutes) into /tmp/hyb; it outlives the call (setsid).
source benchmarks/gpu/gguf.sh
cd /tmp/rh
PYTHONPATH=/tmp/gsite setsid nohup python3 train_cuda/scripts/real_default.py --teacher /tmp/smol.gguf --corpus /tmp/corpus \
  --settings train_cuda/configs/real_hybrid_target.yaml --out /tmp/hyb > /tmp/hyb.log 2>&1 < /dev/null &
sleep 30; tail -c 300 /tmp/hyb.log
