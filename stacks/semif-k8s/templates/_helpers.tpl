{{/* The release's base name, at most 52 characters (suffixes like -gateway-replicas still fit in 63). */}}
{{- define "semif.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "semif.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The replicas' selector. */}}
{{- define "semif.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end -}}

{{/* The gateway's selector. */}}
{{- define "semif.gatewaySelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "semif.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The headless Service whose DNS name lists every ready replica (the gateway's servers). */}}
{{- define "semif.replicasHost" -}}
{{- printf "%s-replicas.%s.svc.cluster.local" (include "semif.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "semif.terminationGrace" -}}
{{- add .Values.shutdown.preStopSleepSeconds .Values.shutdown.graceSeconds .Values.shutdown.marginSeconds -}}
{{- end -}}

{{/* Requests and limits with every quantity a string: server-side apply rejects a bare number
(`nvidia.com/gpu: 1`, "expected string"), which client-side apply and the schemas accept. */}}
{{- define "semif.resources" -}}
{{- range $bound, $quantities := . }}
{{ $bound }}:
{{- range $name, $quantity := $quantities }}
  {{ $name }}: {{ $quantity | toString | quote }}
{{- end }}
{{- end }}
{{- end -}}
