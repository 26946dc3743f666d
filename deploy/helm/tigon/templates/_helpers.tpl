{{/* Names and labels. */}}
{{- define "tigon.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tigon.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tigon.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tigon.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tigon.labels" -}}
{{ include "tigon.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tigon
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tigon.image" -}}
{{- printf "%s:%s" .repository .tag }}
{{- end }}

{{/* A container securityContext that meets the "restricted" Pod Security Standard. */}}
{{- define "tigon.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{- define "tigon.objectStoreSecret" -}}
{{- if .Values.objectStore.credentialsSecret }}
{{- .Values.objectStore.credentialsSecret }}
{{- else if .Values.minio.enabled }}
{{- printf "%s-object-store" (include "tigon.fullname" .) }}
{{- end }}
{{- end }}

{{- define "tigon.objectStoreEndpoint" -}}
{{- if .Values.objectStore.endpoint }}
{{- .Values.objectStore.endpoint }}
{{- else if and .Values.minio.enabled (eq .Values.objectStore.provider "minio") }}
{{- printf "http://%s-minio.%s.svc.cluster.local:9000" (include "tigon.fullname" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/*
Checks the values cannot express in JSON schema; each failure names the value and the fix.
The job template rules are those of tigon.platform.templates.JobTemplate.
*/}}
{{- define "tigon.validate" -}}
{{- range $key, $t := .Values.jobTemplates }}
{{- if ne $key $t.name }}
{{- fail (printf "jobTemplates.%s: its name is %q; the key and `name` must be equal" $key $t.name) }}
{{- end }}
{{- $nnodes := int (default 1 $t.nnodes) }}
{{- $max := int (default 1 $t.max_nnodes) }}
{{- if gt $nnodes $max }}
{{- fail (printf "jobTemplates.%s: nnodes %d is above max_nnodes %d; raise max_nnodes or lower nnodes" $key $nnodes $max) }}
{{- end }}
{{- if and $.Values.kueue.enabled $t.queue (ne $t.queue $.Values.kueue.localQueue) }}
{{- fail (printf "jobTemplates.%s: queue %q is not kueue.localQueue %q, the LocalQueue the chart creates; name that one" $key $t.queue $.Values.kueue.localQueue) }}
{{- end }}
{{- $gpus := int (default 0 $t.gpus_per_node) }}
{{- $nproc := int (default 1 $t.nproc_per_node) }}
{{- if and $gpus (ne $gpus $nproc) }}
{{- fail (printf "jobTemplates.%s: nproc_per_node %d must equal gpus_per_node %d (one process per GPU)" $key $nproc $gpus) }}
{{- end }}
{{- end }}
{{- with .Values.podTemplates.default }}
{{- if not (hasKey $.Values.jobTemplates .) }}
{{- fail (printf "podTemplates.default is %q, which names no job template; these exist: %s" . (keys $.Values.jobTemplates | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- if and (eq .Values.objectStore.provider "minio") (not .Values.minio.enabled) (not .Values.objectStore.endpoint) }}
{{- fail "objectStore.provider is minio but minio.enabled is false and objectStore.endpoint is empty: enable minio or set the endpoint" }}
{{- end }}
{{- if and .Values.tritonCache.enabled .Values.hfCache.enabled (eq .Values.tritonCache.mountPath .Values.hfCache.mountPath) }}
{{- fail (printf "tritonCache.mountPath and hfCache.mountPath are both %s: give each cache its own path" .Values.hfCache.mountPath) }}
{{- end }}
{{- if and (eq .Values.minio.service.type "NodePort") (not .Values.minio.service.nodePort) }}
{{- fail "minio.service.type is NodePort: set minio.service.nodePort (30000-32767)" }}
{{- end }}
{{- end }}

{{/*
The persistent caches of training pods, as a YAML list: the volume name (also the claim's suffix and its
component label), the values section, and the variable that points the process at the mount.
*/}}
{{- define "tigon.caches" -}}
- {name: triton-cache, env: TRITON_CACHE_DIR, values: {{ toJson .Values.tritonCache }}}
- {name: hf-cache, env: HF_HOME, values: {{ toJson .Values.hfCache }}}
{{- end }}

{{/*
The claim a cache mounts: its existingClaim, else the chart's claim <fullname>-<name> in each training namespace.
Arguments: dict "root" $ "cache" <an entry of tigon.caches>.
*/}}
{{- define "tigon.cacheClaimName" -}}
{{- default (printf "%s-%s" (include "tigon.fullname" .root) .cache.name) .cache.values.existingClaim }}
{{- end }}

{{/*
The cache's PersistentVolumeClaim in every training namespace, kept on uninstall (only a cache, but a warm one);
none when the cache is off or names an existing claim. Arguments: as tigon.cacheClaimName.
*/}}
{{- define "tigon.cacheClaims" -}}
{{- $root := .root }}
{{- $cache := .cache }}
{{- if and $cache.values.enabled (not $cache.values.existingClaim) }}
{{- range $ns := $root.Values.namespaces.training }}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {{ include "tigon.cacheClaimName" (dict "root" $root "cache" $cache) }}
  namespace: {{ $ns }}
  labels:
    {{- include "tigon.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $cache.name }}
  annotations:
    helm.sh/resource-policy: keep
spec:
  accessModes: {{- toYaml $cache.values.accessModes | nindent 4 }}
  {{- with $cache.values.storageClassName }}
  storageClassName: {{ . }}
  {{- end }}
  resources:
    requests:
      storage: {{ $cache.values.size }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The pod a job template gives a training task: a PodTemplateSpec for Flyte's PodTemplate.
Flyte merges the container named "default" into every container of the task pod; the task's own
resources (set by tigon.platform from the same template) take precedence over these.
Arguments: dict "root" $ "template" <job template> ["sharedMemory" false: no /dev/shm volume].
Defaults mirror tigon.platform.templates.JobTemplate for keys a template leaves out.
*/}}
{{- define "tigon.trainingPodTemplateSpec" -}}
{{- $root := .root }}
{{- $t := .template }}
{{- $v := $root.Values }}
{{- $gpus := int (default 0 $t.gpus_per_node) }}
{{- $shm := "1Gi" }}
{{- if hasKey $t "shared_memory" }}{{ $shm = $t.shared_memory }}{{ end }}
{{- if and (hasKey . "sharedMemory") (not .sharedMemory) }}{{ $shm = "" }}{{ end }}
{{- $sa := "tigon-trainer" }}
{{- if hasKey $t "service_account" }}{{ $sa = $t.service_account }}{{ end }}
{{- $env := dict }}
{{- range $name, $value := (default dict $t.env) }}{{ $_ := set $env $name $value }}{{ end }}
{{- $caches := list }}
{{- range (include "tigon.caches" $root | fromYamlArray) }}
{{- if .values.enabled }}{{ $caches = append $caches . }}{{ end }}
{{- end }}
{{- range $caches }}
{{- if not (hasKey $env .env) }}{{ $_ := set $env .env .values.mountPath }}{{ end }}
{{- end }}
{{- with $v.objectStore.region }}{{ $_ := set $env "AWS_REGION" . }}{{ end }}
{{- with (include "tigon.objectStoreEndpoint" $root) }}
{{- $_ := set $env "AWS_ENDPOINT_URL" . }}
{{- $_ := set $env "FSSPEC_S3_ENDPOINT_URL" . }}
{{- $_ := set $env "FLYTE_AWS_ENDPOINT" . }}
{{- end }}
{{- $secret := include "tigon.objectStoreSecret" $root }}
{{- $pullSecrets := concat (default list $t.image_pull_secrets) $v.trainer.imagePullSecrets | uniq }}
metadata:
  labels:
    app.kubernetes.io/name: tigon
    app.kubernetes.io/component: training
    tigon.dev/job-template: {{ $t.name }}
spec:
  {{- if $sa }}
  serviceAccountName: {{ $sa }}
  {{- end }}
  automountServiceAccountToken: {{ $v.trainer.automountServiceAccountToken }}
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ $v.trainer.securityContext.runAsUser }}
    runAsGroup: {{ $v.trainer.securityContext.runAsGroup }}
    fsGroup: {{ $v.trainer.securityContext.fsGroup }}
    seccompProfile:
      type: RuntimeDefault
  {{- with $t.node_selector }}
  nodeSelector: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $t.tolerations }}
  tolerations: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $t.priority_class }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  containers:
    - name: default
      image: {{ $t.image }}
      env:
        {{- range $name := keys $env | sortAlpha }}
        - name: {{ $name }}
          value: {{ get $env $name | quote }}
        {{- end }}
        {{- range $name, $ref := (default dict $t.secret_env) }}
        - name: {{ $name }}
          valueFrom:
            secretKeyRef:
              name: {{ $ref.secret }}
              key: {{ $ref.key }}
              optional: {{ ne $ref.optional false }}
        {{- end }}
        {{- if $secret }}
        {{- range $name := list "AWS_ACCESS_KEY_ID" "AWS_SECRET_ACCESS_KEY" }}
        {{- range $prefix := list "" "FLYTE_" }}
        - name: {{ printf "%s%s" $prefix $name }}
          valueFrom:
            secretKeyRef:
              name: {{ $secret }}
              key: {{ $name }}
        {{- end }}
        {{- end }}
        {{- end }}
      resources:
        requests:
          cpu: {{ default "2" $t.cpu | quote }}
          memory: {{ default "4Gi" $t.memory | quote }}
          {{- if $gpus }}
          nvidia.com/gpu: {{ $gpus }}
          {{- end }}
        limits:
          cpu: {{ default "2" $t.cpu | quote }}
          memory: {{ default "4Gi" $t.memory | quote }}
          {{- if $gpus }}
          nvidia.com/gpu: {{ $gpus }}
          {{- end }}
      securityContext:
        allowPrivilegeEscalation: false
        privileged: false
        capabilities:
          drop: [ALL]
      {{- if or $shm $caches }}
      volumeMounts:
        {{- if $shm }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
        {{- range $caches }}
        - name: {{ .name }}
          mountPath: {{ .values.mountPath }}
        {{- end }}
      {{- end }}
  {{- if or $shm $caches }}
  volumes:
    {{- if $shm }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $shm }}
    {{- end }}
    {{- range $caches }}
    - name: {{ .name }}
      persistentVolumeClaim:
        claimName: {{ include "tigon.cacheClaimName" (dict "root" $root "cache" .) }}
    {{- end }}
  {{- end }}
{{- end }}
