# syntax=docker/dockerfile:1
#
# sglang-router in front of ferry workers (docs/deployment.md#several-hosts-behind-a-router).
#
#   docker build -f docker/router.Dockerfile -t ferry-router:0.3.2 docker
#   docker run --init -p 30000:30000 ferry-router:0.3.2 \
#       --worker-urls http://gpu-host-1:30000 http://gpu-host-2:30000 --policy cache_aware
#
# sglang-router is a manylinux wheel holding a Rust binary (a Python launcher around it); it
# needs no GPU and no model. Arguments after the image name are the router's flags.
FROM python:3.12-slim

RUN pip install --no-cache-dir sglang-router==0.3.2

USER 65534:65534
EXPOSE 30000
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["python", "-m", "sglang_router.launch_router", "--host", "0.0.0.0", "--port", "30000"]
