#!/usr/bin/env bash
# tigon on kind: create the cluster, install the chart with the kind values, print the demo command.
#
#   deploy/kind/quickstart.sh                 # cluster "tigon", release "tigon" in namespace "flyte"
#   BUILD_IMAGE=1 deploy/kind/quickstart.sh   # also build the training image and load it into kind
#   SKIP_TEST=1 deploy/kind/quickstart.sh     # skip `helm test`
#
# Needs: docker (or podman), kind >= 0.29, kubectl, helm >= 3.14, and network access to Flyte's chart
# repository and the image registries (the training-operator chart is in the repository). See docs/deploy.md.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
chart="$root/deploy/helm/tigon"
cluster="${CLUSTER:-tigon}"
release=tigon          # values-kind.yaml names tigon-minio / tigon-postgres in namespace flyte
namespace=flyte
image="${TIGON_IMAGE:-ghcr.io/tigon-ml/tigon:0.1.0-cpu}"

for tool in kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "quickstart: $tool is not installed (see docs/deploy.md, step 1)" >&2; exit 1; }
done

if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
  echo "==> kind cluster $cluster exists; reusing it"
else
  echo "==> creating kind cluster $cluster"
  kind create cluster --name "$cluster" --config "$here/cluster.yaml"
fi
kubectl config use-context "kind-$cluster" >/dev/null

if [[ "${BUILD_IMAGE:-0}" == "1" ]]; then
  echo "==> building $image (CPU variant: no flash-attn) and loading it into kind"
  docker build -f "$root/docker/Dockerfile" --build-arg INSTALL_FLASH_ATTN=0 -t "$image" "$root"
  kind load docker-image "$image" --name "$cluster"
fi

echo "==> fetching flyte-binary into the chart (training-operator is committed in its charts/)"
helm repo add flyteorg https://flyteorg.github.io/flyte --force-update >/dev/null
helm dependency build "$chart"

echo "==> installing release $release into namespace $namespace"
helm upgrade --install "$release" "$chart" \
  --namespace "$namespace" --create-namespace \
  -f "$chart/values-kind.yaml" \
  --wait --timeout 15m

if [[ "${SKIP_TEST:-0}" != "1" ]]; then
  echo "==> helm test: PyTorchJob CRD and Flyte endpoint"
  helm test "$release" --namespace "$namespace" --timeout 5m --logs
fi

config="${FLYTECTL_CONFIG_DIR:-$HOME/.flyte}/config-tigon-kind.yaml"
mkdir -p "$(dirname "$config")"
cat > "$config" <<CONFIG
admin:
  endpoint: dns:///localhost:30081
  insecure: true
CONFIG

cat <<NEXT

tigon is running on kind. Flyte console: http://localhost:30080/console

Run the demo fine-tune on the cluster (CPU job template, two worker processes):

  export FLYTECTL_CONFIG=$config
  pyflyte run --remote --project tigon --domain development --service-account tigon-trainer \\
    workflows/finetune.py finetune --job-template cpu-small

Delete everything: kind delete cluster --name $cluster
NEXT
