{{/* Names and labels of the training-operator chart. */}}
{{- define "training-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "training-operator.selectorLabels" -}}
app.kubernetes.io/name: training-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "training-operator.labels" -}}
{{ include "training-operator.selectorLabels" . }}
app.kubernetes.io/component: training-operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret the operator's cert-controller writes its CA and serving certificate into. */}}
{{- define "training-operator.certSecret" -}}
{{- printf "%s-webhook-cert" (include "training-operator.fullname" .) }}
{{- end }}

{{/*
The ValidatingWebhookConfiguration name is fixed by the v1.9 operator: its cert-controller injects the CA
bundle into the configuration of exactly this name (pkg/cert), so it cannot carry the release name.
*/}}
{{- define "training-operator.webhookConfigurationName" -}}
validator.training-operator.kubeflow.org
{{- end }}

