{{/* Names and labels shared by every template. */}}

{{- define "splitfeed.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitfeed.fullname" -}}
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

{{/* Cluster-scoped objects carry the release namespace: two releases of the
same name in two namespaces must not fight over one ClusterRole. */}}
{{- define "splitfeed.clusterName" -}}
{{- printf "%s-%s" (include "splitfeed.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitfeed.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitfeed.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitfeed.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "splitfeed.labels" -}}
helm.sh/chart: {{ include "splitfeed.chart" . }}
{{ include "splitfeed.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: splitfeed
{{- end }}

{{- define "splitfeed.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "splitfeed.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "splitfeed.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "splitfeed.sidecarImage" -}}
{{- default (include "splitfeed.image" .) .Values.sidecar.image }}
{{- end }}

{{/* The one namespace watched in single-namespace mode. */}}
{{- define "splitfeed.watchNamespace" -}}
{{- default .Release.Namespace .Values.watch.namespace }}
{{- end }}

{{/* The namespaces watched when allNamespaces is false, as a JSON list:
watch.namespaces, else the one of splitfeed.watchNamespace. */}}
{{- define "splitfeed.watchNamespaces" -}}
{{- if .Values.watch.namespaces }}
{{- toJson .Values.watch.namespaces }}
{{- else }}
{{- list (include "splitfeed.watchNamespace" .) | toJson }}
{{- end }}
{{- end }}

{{- define "splitfeed.webhookServiceName" -}}
{{- printf "%s-webhook" (include "splitfeed.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitfeed.webhookCertSecretName" -}}
{{- if .Values.webhook.certManager.enabled }}
{{- default (printf "%s-webhook-tls" (include "splitfeed.fullname" .)) .Values.webhook.certSecretName }}
{{- else }}
{{- required "webhook.certSecretName (a kubernetes.io/tls Secret) is required when webhook.enabled is true and webhook.certManager.enabled is false" .Values.webhook.certSecretName }}
{{- end }}
{{- end }}

{{/* Who the operator is to each job's NetworkPolicy (docs/security.md): its pods, by the
Deployment's selector labels, in the release namespace (by the label the apiserver sets
on every namespace), as a JSON list of NetworkPolicyPeers. */}}
{{- define "splitfeed.operatorPeers" -}}
{{- $pods := dict "matchLabels" (include "splitfeed.selectorLabels" . | fromYaml) }}
{{- $namespace := dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace) }}
{{- list (dict "namespaceSelector" $namespace "podSelector" $pods) | toJson }}
{{- end }}
