#!/usr/bin/env bash
# Try the chat app the way a new user would: start `potluck` in a tmux pane, type a
# message, wait for the reply, and print the captured screen.
#
#   packaging/tmux-try-chat.sh ["message"]    (POTLUCK=/path/to/potluck to pick a binary)
#
# History and settings go to a temporary POTLUCK_HOME, so your own are never touched.
set -euo pipefail

MESSAGE=${1:-"What is the capital of France? Answer in one sentence."}
POTLUCK=${POTLUCK:-potluck}
SESSION=potluck-try-$$
HOME_DIR=$(mktemp -d)
OUT=${OUT:-$HOME_DIR/screen.txt}
WAIT_S=${WAIT_S:-180}

cleanup() { tmux kill-session -t "$SESSION" 2>/dev/null || true; }
trap cleanup EXIT

screen() { tmux capture-pane -p -t "$SESSION"; }

wait_for() {  # wait_for REGEX DESCRIPTION: poll the pane until REGEX shows up
    local deadline=$((SECONDS + WAIT_S))
    until screen | grep -Eq "$1"; do
        if ((SECONDS > deadline)); then
            echo "timed out waiting for $2; the screen was:" >&2
            screen >&2
            exit 1
        fi
        sleep 0.5
    done
}

tmux new-session -d -s "$SESSION" -x 120 -y 36 \
    "env POTLUCK_HOME='$HOME_DIR' TERM=xterm-256color '$POTLUCK' --max-tokens 48 --threads 2"

wait_for '^.*ready ·' "the model to load"
tmux send-keys -t "$SESSION" -l "$MESSAGE"
tmux send-keys -t "$SESSION" Enter
wait_for 'generating' "the reply to start"
wait_for '^.*ready ·' "the reply to finish"
screen | tee "$OUT"
echo "--- potluck locate (the try run's files) ---"
POTLUCK_HOME=$HOME_DIR "$POTLUCK" locate
tmux send-keys -t "$SESSION" C-q
