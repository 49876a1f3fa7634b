# After heads.sh: wait for the run's pseudo-labels (the teacher's greedy continuations and chat
# answers, and the questions it wrote; deterministic for a teacher and real_heads.yaml) and bring
# them back as $OUT/labels.tar.gz: kept in .gpu/labels/ and carried into a later heads.sh, they save
# that run about 5 of its 13 minutes. Usage: labels.sh [SECONDS to wait]
files="prompts.jsonl heldout.jsonl questions.jsonl chat.jsonl chat-heldout.jsonl"
for i in $(seq 1 ${1:-500}); do [ -f /tmp/heads/chat-heldout.jsonl ] && break; sleep 1; done
cd /tmp/heads && tar -czf $OUT/labels.tar.gz $files && ls -la $OUT/labels.tar.gz
