# After heads.sh (its /tmp/rh, /tmp/corpus, /tmp/smol.gguf): a second heads run beside it, into
# /tmp/hv, on the carried pseudo-labels, with the yaml's settings changed: `variant.sh STAGES
# SECTION.KEY=VALUE ...`, e.g. `variant.sh medusa1 medusa1.num_layers=1` (the twenty-seventh
# session's A/B of 1 and 2 ResBlocks a Medusa head). Carry .gpu/labels with it.
stages=$1; shift
mkdir -p /tmp/hv && tar -xzf .gpu/labels/labels.tar.gz -C /tmp/hv
python3 - "$stages" "$@" <<'PY'
import sys, yaml
s = yaml.safe_load(open("/tmp/rh/train_cuda/configs/real_heads.yaml"))
s["stages"] = [x.strip() for x in sys.argv[1].split(",")]
for change in sys.argv[2:]:
    key, value = change.split("=", 1)
    section, name = key.split(".")
    s[section][name] = yaml.safe_load(value)
yaml.safe_dump(s, open("/tmp/hv.yaml", "w"))
print({k: s[k] for k in s["stages"]})
PY
cd /tmp/rh
PYTHONPATH=/tmp/gsite setsid nohup python3 train_cuda/scripts/real_heads.py --base /tmp/smol.gguf --corpus /tmp/corpus \
  --out /tmp/hv --settings /tmp/hv.yaml > /tmp/hv.log 2>&1 < /dev/null &
sleep 5; tail -c 200 /tmp/hv.log
