# A stand-in for python:3.11-slim on machines without Docker Hub, built by hack/build-images.sh on top of
# diloco.local/debian:bookworm (debootstrap --variant=minbase): Debian's Python 3.11 with a virtualenv on
# PATH, so `python` and `pip install` behave as in the official image. The build context holds
# host-ca-bundle.crt, the build host's CA bundle: pip (and anything else using OpenSSL) trusts it, which
# networks that inspect TLS need. Local test images only; the project's Dockerfile never depends on it.
ARG DEBIAN_IMAGE=diloco.local/debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
COPY host-ca-bundle.crt /etc/ssl/certs/diloco-host-ca-bundle.crt
RUN apt-get -o Acquire::Retries=3 update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version'
ENV PATH=/opt/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/diloco-host-ca-bundle.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/diloco-host-ca-bundle.crt \
    SSL_CERT_FILE=/etc/ssl/certs/diloco-host-ca-bundle.crt \
    PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
CMD ["python3"]
