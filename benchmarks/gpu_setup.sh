# Sourced by the run_gpu*.sh scripts on the GPU machine (offline), from the repository root:
# installs torchao from .whl/ (downloaded on the dev machine and carried) into /tmp/site,
# installs the project (its `loka` backend entry point), and prints the GPU and versions.
# $SCRIPT names the calling script in messages.
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        || echo "$SCRIPT: torchao wheel install failed; torchao rows will record the error"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    # .whl/ is git-ignored: it reaches the GPU machine only when carried explicitly.
    echo "$SCRIPT: no .whl/*.whl here (carry '.whl' to the GPU machine); torchao rows will be errors"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . \
    || echo "$SCRIPT: project install failed; loka rows will record the error"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
