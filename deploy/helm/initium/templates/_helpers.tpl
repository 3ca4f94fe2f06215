{{/* The chart's name: "initium" unless nameOverride says otherwise. */}}
{{- define "initium.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The name of every object: fullnameOverride, else the release name when it contains the
chart's name (`helm install initium ...` gives "initium", the kustomize base's name), else
"<release>-<name>".
*/}}
{{- define "initium.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "initium.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the Pods of this release (Deployment, Service, PDB, anti-affinity). */}}
{{- define "initium.selectorLabels" -}}
app.kubernetes.io/name: {{ include "initium.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "initium.labels" -}}
{{ include "initium.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* The image: repository:tag, or repository@digest. */}}
{{- define "initium.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Where the Secret of tls.mode=secret is mounted. */}}
{{- define "initium.tlsDir" -}}/etc/initium/tls{{- end -}}

{{/*
Checks of values that values.schema.json cannot express; each fails rendering with a
sentence saying what to set.
*/}}
{{- define "initium.validate" -}}
{{- if and (eq .Values.tls.mode "secret") (not .Values.tls.secretName) -}}
{{- fail "tls.mode is secret but tls.secretName is empty: name the Secret holding tls.crt and tls.key (e.g. the secretName of a cert-manager Certificate), or use tls.mode=selfManaged" -}}
{{- end -}}
{{- if and (eq .Values.tls.mode "secret") .Values.tls.selfManagedSecret -}}
{{- fail "tls.selfManagedSecret is only for tls.mode=selfManaged; with tls.mode=secret, name the certificate's Secret in tls.secretName" -}}
{{- end -}}
{{- if eq (int .Values.metrics.port) 8443 -}}
{{- fail "metrics.port is 8443, the webhook's port: choose another port for the operations listener (default 8080)" -}}
{{- end -}}
{{- end -}}
