#!/usr/bin/env bash
# tigon on kind: create the cluster, build the CPU training image and load it into kind, install the chart
# with the kind values, run `helm test`, print the demo command.
#
#   deploy/kind/quickstart.sh                 # cluster "tigon", release "tigon" in namespace "flyte"
#   BUILD_IMAGE=0 deploy/kind/quickstart.sh   # skip the image build (the image is in the kind node already)
#   SKIP_TEST=1 deploy/kind/quickstart.sh     # skip `helm test`
#
# The training image (the cpu-small job template's, ghcr.io/tigon-ml/tigon:<version>-cpu-<digest>) is not published in
# any registry: this script builds it with docker from docker/Dockerfile and loads it into the kind node.
# Needs: docker, kind >= 0.29, kubectl, helm >= 3.14, and network access: once to Flyte's chart repository
# (https://flyteorg.github.io/flyte, for flyte-binary; the training-operator chart is in the repository),
# and to the image registries. See docs/deploy.md.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
chart="$root/deploy/helm/tigon"
cluster="${CLUSTER:-tigon}"
release=tigon          # values-kind.yaml names tigon-minio / tigon-postgres in namespace flyte
namespace=flyte
# The image the demo's job template runs: tigon's workflow gives it to the task pods.
image="$(sed -n 's/^image: *//p' "$root/deploy/job-templates/cpu-small.yaml")"
build_image="${BUILD_IMAGE:-1}"

tools=(kind kubectl helm)
if [[ "$build_image" == "1" ]]; then
  tools+=(docker)
fi
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null || { echo "quickstart: $tool is not installed (see docs/deploy.md, step 1)" >&2; exit 1; }
done

if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
  echo "==> kind cluster $cluster exists; reusing it"
else
  echo "==> creating kind cluster $cluster"
  kind create cluster --name "$cluster" --config "$here/cluster.yaml"
fi
kubectl config use-context "kind-$cluster" >/dev/null

if [[ "$build_image" == "1" ]]; then
  echo "==> building $image (CPU variant: Ubuntu base, CPU torch, no flash-attn) and loading it into kind"
  docker build -f "$root/docker/Dockerfile" --build-arg VARIANT=cpu -t "$image" "$root"
  kind load docker-image "$image" --name "$cluster"
else
  echo "==> BUILD_IMAGE=0: not building $image; the demo's pods need it in the kind node (kind load docker-image)"
fi

# Helm refuses to install a chart while any dependency it declares is missing from charts/, even a disabled one.
if [[ "$(helm dependency list "$chart" | awk '$1 == "flyte-binary" { print $NF }')" == "ok" ]]; then
  echo "==> flyte-binary is in the chart's charts/ already"
else
  echo "==> downloading flyte-binary into the chart (training-operator is committed in its charts/)"
  if ! { helm repo add flyteorg https://flyteorg.github.io/flyte --force-update >/dev/null &&
         helm dependency build "$chart"; }; then
    echo "quickstart: could not download flyte-binary from https://flyteorg.github.io/flyte;" \
         "helm dependency build needs network access once (docs/deploy.md, step 2.3)" >&2
    exit 1
  fi
fi

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
  tigon submit examples/demo.yaml --job-template cpu-small \\
    --project tigon --domain development --service-account tigon-trainer

This checks the run here, uploads the demo's data with it and runs every task in the cpu-small
template's image; add --dry-run to see the pyflyte command it runs.

Delete everything: kind delete cluster --name $cluster
NEXT
