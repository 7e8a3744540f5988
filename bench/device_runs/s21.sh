#!/usr/bin/env bash
# Session 21 (issue 33 item 3, the third row): `bash bench/device_runs/s21.sh TASK...` runs the named tasks in order,
# each with what is left of a 585 s budget (as s19.sh; a task that needs more than is left is skipped and says so).
# Parts and environment: s18_site.sh (the session-19 stage); veRL's 12 wheels travel in .whl/verl/
# (bench/device_runs/verl_wheels.sh, 3.4 MB; carry .whl) and are installed into the site here once.
# Tasks:
#   verl      veRL 0.9.1 (its default v1 trainer) on the SmolLM2 job, $VERL_STEPS steps (20), per-phase seconds;
#             if it fails with time left, once more with veRL's legacy RayPPOTrainer (verl_v0)
#   verl_v0   the legacy trainer only (trainer.use_v1=False)
#   trl       TRL 1.16 GRPOTrainer on the same job, $TRL_STEPS steps (20)
#   smollm2   hpcrl's SmolLM2 recipe through hpcrl submit, $STEPS steps (30)
set -u
T0=$SECONDS
BUDGET=${BUDGET:-585}
source bench/device_runs/s18_site.sh
source bench/device_runs/tasks.sh
# veRL's vLLM server resolves files of a local model directory; offline, so no lookup waits on a network there is not
vpeer() { (export HF_HUB_OFFLINE=1; peer "$@"); }
verl_site() {  # veRL's wheels into the site, once
  python3 -c "import verl, transfer_queue, uvicorn, watchfiles, model_hosting_container_standards" 2>/dev/null && return 0
  ls .whl/verl/*.whl > /dev/null 2>&1 || { echo "== verl: no .whl/verl/ (bench/device_runs/verl_wheels.sh here, carry .whl)"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/verl/*.whl || return 1
  echo "== verl wheels installed $((SECONDS - T0)) s"
}
for task in "$@"; do
  echo "== $task at $((SECONDS - T0)) s"
  case $task in
    verl)
      need 330 $task && fetched && verl_site || continue
      vpeer verl bench/peers/verl_grpo.py "${VERL_STEPS:-20}" && continue
      nvidia-smi --query-gpu=memory.used --format=csv,noheader
      need 240 verl_v0 && vpeer verl_v0 bench/peers/verl_grpo.py "${VERL_STEPS:-20}" --legacy ;;
    verl_v0) need 330 $task && fetched && verl_site && vpeer verl_v0 bench/peers/verl_grpo.py "${VERL_STEPS:-20}" --legacy ;;
    trl) need 200 $task && fetched && peer trl bench/peers/trl_grpo.py "${TRL_STEPS:-20}" ;;
    smollm2) need 200 $task && fetched && recipe vllm "${STEPS:-30}" ;;
    *) echo "== unknown task $task" ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== done $((SECONDS - T0)) s"
