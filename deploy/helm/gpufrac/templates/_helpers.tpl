{{/* Names: every object is <fullname>-<component>. */}}
{{- define "gpufrac.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpufrac.scheduler" -}}{{ include "gpufrac.fullname" . }}-scheduler{{- end -}}
{{- define "gpufrac.webhook" -}}{{ include "gpufrac.fullname" . }}-webhook{{- end -}}
{{- define "gpufrac.nodeAgent" -}}{{ include "gpufrac.fullname" . }}-node-agent{{- end -}}
{{- define "gpufrac.mpsDaemon" -}}{{ include "gpufrac.fullname" . }}-mps{{- end -}}
{{- define "gpufrac.dashboard" -}}{{ include "gpufrac.fullname" . }}-dashboard{{- end -}}

{{/* The service-account user names the API server sees. */}}
{{- define "gpufrac.schedulerUser" -}}system:serviceaccount:{{ .Release.Namespace }}:{{ include "gpufrac.scheduler" . }}{{- end -}}
{{/* The webhook's --scheduler-user list, as a JSON (and CEL) list of strings. */}}
{{- define "gpufrac.schedulerUsers" -}}
{{- $users := list -}}
{{- if .Values.scheduler.enabled -}}{{- $users = append $users (include "gpufrac.schedulerUser" .) -}}{{- end -}}
{{- range .Values.webhook.extraSchedulerUsers -}}{{- $users = append $users . -}}{{- end -}}
{{- toJson $users -}}
{{- end -}}
{{- define "gpufrac.nodeAgentUser" -}}system:serviceaccount:{{ .Release.Namespace }}:{{ include "gpufrac.nodeAgent" . }}{{- end -}}

{{- define "gpufrac.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{- end -}}

{{- define "gpufrac.labels" -}}
app.kubernetes.io/part-of: gpufrac
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Selector labels of a component: pass (list $ "scheduler"). */}}
{{- define "gpufrac.selector" -}}
app.kubernetes.io/name: {{ include "gpufrac.fullname" (index . 0) }}-{{ index . 1 }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
{{- end -}}

{{/*
Whether cert-manager issues the webhook's certificate: provider
certManager, or auto with cert-manager's API installed.
*/}}
{{- define "gpufrac.certManager" -}}
{{- $p := .Values.webhook.certificates.provider -}}
{{- if not (has $p (list "auto" "certManager" "generated")) -}}
{{- fail (printf "webhook.certificates.provider %q: must be auto, certManager or generated" $p) -}}
{{- end -}}
{{- if or (eq $p "certManager") (and (eq $p "auto") (.Capabilities.APIVersions.Has "cert-manager.io/v1")) -}}true{{- end -}}
{{- end -}}

{{/*
The annotation keys that send an object to the webhook: the shorthands and
anything under nvidia.com/container. `has` is the CEL test for a map of
annotations `a`.
*/}}
{{- define "gpufrac.hasKeys" -}}
{{ . }}.exists(k, k.startsWith('nvidia.com/container.') || k.startsWith('kai.scheduler/container.') ||
  k in ['gpu-fraction', 'gpu-memory', 'gpu-fraction.limit', 'gpu-memory.limit',
        'gpu-fraction-num-devices', 'gpu-fraction-container-name',
        'kai.scheduler/gpu-compute-sharing-mode',
        'gpufrac.io/gpu-groups', 'gpufrac.io/resolved-keys'])
{{- end -}}

{{/* A CEL test: the pod (the variable named) carries a GPU memory charge
(gpufrac.io/gpu-memory) on a container or an init container. */}}
{{- define "gpufrac.hasCharge" -}}
({{ . }}.spec.containers.exists(c, has(c.resources.requests) && 'gpufrac.io/gpu-memory' in c.resources.requests || has(c.resources.limits) && 'gpufrac.io/gpu-memory' in c.resources.limits) || (has({{ . }}.spec.initContainers) && {{ . }}.spec.initContainers.exists(c, has(c.resources.requests) && 'gpufrac.io/gpu-memory' in c.resources.requests || has(c.resources.limits) && 'gpufrac.io/gpu-memory' in c.resources.limits)))
{{- end -}}

{{/* What every webhook of the chart shares: pass a dict of name, ns,
caBundle, certManager, path and Values. */}}
{{- define "gpufrac.webhookCommon" -}}
admissionReviewVersions: ["v1"]
sideEffects: None
failurePolicy: {{ .Values.webhook.failurePolicy }}
timeoutSeconds: {{ .Values.webhook.timeoutSeconds }}
clientConfig:
  service:
    namespace: {{ .ns }}
    name: {{ .name }}
    path: {{ .path }}
  {{- if not .certManager }}
  caBundle: {{ .caBundle }}
  {{- end }}
{{- end -}}
