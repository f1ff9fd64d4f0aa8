#!/bin/bash
# The training CLI on a folder of generated JPEGs under each GPU allocator,
# with and without gradient accumulation: does the step fit, at what img/s,
# and what the allocator's pool looks like (metrics.jsonl memory_*).
#
#   bash benchmarks/allocator_benchmark.sh [config] [batch] [microbatch]
#   bash benchmarks/allocator_benchmark.sh experiments/vit_b16_diff.py 1024 512
#
# Prints, per run: exit code, seconds, the compiled step's memory line, and
# per log step img/s and the allocator's figures. Results: benchmarks/RESULTS.md.
config=${1:-experiments/vit_b16_diff.py}
batch=${2:-1024}
micro=${3:-$((batch / 2))}
out=${OUT:-/tmp/allocator_benchmark}
mkdir -p "$out"
python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
import cli_benchmark as c
c.make_folder('/tmp/darl_jpegs_alloc', 3000, 200)"
run() {
  name=$1; envs=$2; shift 2
  start=$(date +%s)
  env $envs python3 -m darl_jax.main --config="$config" --workdir=/tmp/w_alloc_$name \
    --config.data.name=image_folder --config.data.path=/tmp/darl_jpegs_alloc \
    --config.batch_size="$batch" --config.total_steps=40 --config.log_every_steps=5 \
    --config.eval_every_steps=0 --config.predictions.num_images=0 \
    --config.checkpoint_every_steps=1000 --config.tensorboard=False "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $? in $(( $(date +%s) - start )) s"
  grep -E "train step compiled|Out of memory" "$out/$name.log" | cut -c1-300
  python3 -c "
import json
for l in open('/tmp/w_alloc_$name/metrics.jsonl'):
  r = json.loads(l)
  print(r['step'], round(r.get('img_per_sec', 0)), {k: round(v, 2) for k, v in r.items() if k.startswith('memory_')})" 2>/dev/null
  rm -rf /tmp/w_alloc_$name
}
run bfc XLA_PYTHON_CLIENT_ALLOCATOR=default
run bfc_accumulated XLA_PYTHON_CLIENT_ALLOCATOR=default --config.microbatch_size="$micro"
run cuda_async XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async
