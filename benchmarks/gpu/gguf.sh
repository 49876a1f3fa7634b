# Sourced by heads.sh and hybrid.sh: assemble the teacher's GGUF at /tmp/smol.gguf (the parts
# stash.sh kept and .gpu/g3's), install gguf for its conversion, copy train_cuda, the benchmark's
# prompts and the corpus to /tmp/rh and /tmp/corpus.
set -e
cat /tmp/stash/gg_aa /tmp/stash/gg_ab .gpu/g3/gg_ac > /tmp/smol.gguf
echo "$(cat .gpu/g3/gguf.sha)  /tmp/smol.gguf" | sha256sum -c
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gsite .gpu/g3/gguf-*.whl
rm -rf /tmp/rh /tmp/corpus; mkdir -p /tmp/rh/benchmarks
cp -r train_cuda /tmp/rh/; cp benchmarks/chat_prompts.txt /tmp/rh/benchmarks/; cp -r .gpu/g3/corpus /tmp/corpus
