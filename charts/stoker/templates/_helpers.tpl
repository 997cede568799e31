{{/*
The chart name, or nameOverride.
*/}}
{{- define "stoker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Prefix of every object name: fullnameOverride, else the release name when it already contains
the chart name (release "stoker" gives "stoker-dispatcher", not "stoker-stoker-dispatcher"),
else "<release>-<name>". Truncated so that suffixes such as "-dispatcher" still fit in 63.
*/}}
{{- define "stoker.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "stoker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every object.
*/}}
{{- define "stoker.labels" -}}
helm.sh/chart: {{ include "stoker.chart" . }}
{{ include "stoker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stoker
{{- end }}

{{/*
Labels that select the operator pods; immutable in the Deployment's selector.
*/}}
{{- define "stoker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stoker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The operator's ServiceAccount.
*/}}
{{- define "stoker.serviceAccountName" -}}
{{- include "stoker.fullname" . }}
{{- end }}

{{/*
"repository:tag" of an entry of .Values.images; the tag defaults to the chart's appVersion.
Usage: include "stoker.image" (list . .Values.images.operator)
*/}}
{{- define "stoker.image" -}}
{{- $root := index . 0 }}
{{- $image := index . 1 }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag | toString) }}
{{- end }}

{{/*
Operator replicas: replicaCount with leader election, else exactly one (two unelected
operators would both reconcile).
*/}}
{{- define "stoker.replicas" -}}
{{- if .Values.leaderElection.enabled }}
{{- int64 .Values.replicaCount }}
{{- else }}
{{- 1 }}
{{- end }}
{{- end }}
