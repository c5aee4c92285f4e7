{{/* The chart's name, shortened to a DNS label. */}}
{{- define "multiworld-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Name of the release's own objects; the release name alone when it already holds the chart's name. */}}
{{- define "multiworld-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "multiworld-operator.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "multiworld-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "multiworld-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "multiworld-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "multiworld-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "multiworld-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "multiworld-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "multiworld-operator.operatorSubjects" -}}
- kind: ServiceAccount
  name: {{ include "multiworld-operator.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}

{{/* Watching every namespace (an empty watchNamespaces) takes a ClusterRole; a list takes Roles. */}}
{{- define "multiworld-operator.clusterWide" -}}
{{- if not .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/* Namespaces that get the workers' ServiceAccount and Role, as a JSON list. */}}
{{- define "multiworld-operator.workerNamespaces" -}}
{{- .Values.workers.namespaces | default .Values.watchNamespaces | default (list .Release.Namespace) | toJson }}
{{- end }}

{{/*
What the operator does in a namespace it manages, and no more: watch MultiWorlds and patch their
status (its kopf handlers only watch, so kopf keeps no annotations or finalizers on them), create
and delete their Pods, create their headless Services (owner references delete them), keep
their NetworkPolicies (spec.networkPolicy), and post Events. Used by the ClusterRole (all namespaces) or by each Role (listed namespaces).
*/}}
{{- define "multiworld-operator.managedRules" -}}
- apiGroups: ["multiworld.io"]
  resources: ["multiworlds"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["multiworld.io"]
  resources: ["multiworlds/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Each MultiWorld's memory (ConfigMap <mw>).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "update"]
{{- end }}

{{/* The admission webhook's Service (a DNS label: the full name leaves room for the suffix). */}}
{{- define "multiworld-operator.webhookService" -}}
{{- printf "%s-webhook" (include "multiworld-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/* The name the API server calls the webhook by: its certificate is made for it. */}}
{{- define "multiworld-operator.webhookHost" -}}
{{- printf "%s.%s.svc" (include "multiworld-operator.webhookService" .) .Release.Namespace }}
{{- end }}

{{/* The metrics Service (a DNS label: the full name leaves room for the suffix). */}}
{{- define "multiworld-operator.metricsService" -}}
{{- printf "%s-metrics" (include "multiworld-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}
