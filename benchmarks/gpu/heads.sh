# Start train_cuda/scripts/real_heads.py on the teacher in the background (about 13 minutes at the
# yaml's 2500 steps a head set; `heads.sh STEPS` for another count, `heads.sh STEPS "medusa1, medusa2"`
# for other stages than the yaml's); it outlives the call (setsid), later calls run beside it.
# With .gpu/labels/labels.tar.gz carried too (`labels.sh` brought it back from an earlier run), the
# teacher's pseudo-labels and questions are not made again: the run starts at its training stages.
source benchmarks/gpu/gguf.sh
if [ -f .gpu/labels/labels.tar.gz ]; then mkdir -p /tmp/heads && tar -xzf .gpu/labels/labels.tar.gz -C /tmp/heads && ls /tmp/heads; fi
sed -i "s/^  steps: [0-9]*$/  steps: ${1:-2500}/" /tmp/rh/train_cuda/configs/real_heads.yaml
[ -n "$2" ] && sed -i "s/^stages: \[[^]]*\]/stages: [$2]/" /tmp/rh/train_cuda/configs/real_heads.yaml
grep "^stages" /tmp/rh/train_cuda/configs/real_heads.yaml
cd /tmp/rh
PYTHONPATH=/tmp/gsite setsid nohup python3 train_cuda/scripts/real_heads.py --base /tmp/smol.gguf --corpus /tmp/corpus \
  --out /tmp/heads > /tmp/heads.log 2>&1 < /dev/null &
sleep 30; tail -c 300 /tmp/heads.log
