{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "extauthz.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name, unless it already contains the chart name. */}}
{{- define "extauthz.fullname" -}}
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

{{- define "extauthz.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "extauthz.selectorLabels" -}}
app.kubernetes.io/name: {{ include "extauthz.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "extauthz.labels" -}}
helm.sh/chart: {{ include "extauthz.chart" . }}
{{ include "extauthz.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: ext-authz
{{- end }}

{{- define "extauthz.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "extauthz.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "extauthz.policyConfigMapName" -}}
{{- if .Values.existingPolicyConfigMap }}
{{- .Values.existingPolicyConfigMap }}
{{- else }}
{{- printf "%s-policies" (include "extauthz.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The chart's own policy files: `policies` without its `configMaps` key (nor null values). */}}
{{- define "extauthz.policyFiles" -}}
{{- $files := dict }}
{{- range $file, $body := .Values.policies }}
{{- if and (ne $file "configMaps") $body }}
{{- $_ := set $files $file $body }}
{{- end }}
{{- end }}
{{- toJson $files }}
{{- end }}

{{/* The ConfigMaps that make up the policy directory, in order: the chart's (or
existingPolicyConfigMap), then each of policies.configMaps (owned by other teams). */}}
{{- define "extauthz.policySources" -}}
{{- $sources := list }}
{{- if .Values.existingPolicyConfigMap }}
{{- $sources = append $sources .Values.existingPolicyConfigMap }}
{{- else if (include "extauthz.policyFiles" . | fromJson) }}
{{- $sources = append $sources (include "extauthz.policyConfigMapName" .) }}
{{- end }}
{{- range (.Values.policies | default dict).configMaps }}
{{- $sources = append $sources . }}
{{- end }}
{{- toJson $sources }}
{{- end }}

{{/* The Secret the chart creates for identitySalt.value (none when an existing one is named). */}}
{{- define "extauthz.secretName" -}}
{{- printf "%s-secrets" (include "extauthz.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The lease secret the chart's Secret holds: leaseSecret.value, else (with Redis, no
existingSecret) the one already in the cluster, else a new random one. Empty: none. */}}
{{- define "extauthz.leaseSecretValue" -}}
{{- if .Values.leaseSecret.value }}
{{- .Values.leaseSecret.value }}
{{- else if and (not .Values.leaseSecret.existingSecret) (include "extauthz.redisConfigured" .) }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "extauthz.secretName" .) }}
{{- if and $existing (hasKey ($existing.data | default dict) "lease-secret") }}
{{- index $existing.data "lease-secret" | b64dec }}
{{- else }}
{{- randAlphaNum 48 }}
{{- end }}
{{- end }}
{{- end }}

{{- define "extauthz.redisConfigured" -}}
{{- if or .Values.redis.url .Values.redis.existingSecret }}true{{ end }}
{{- end }}

{{/* Worker processes (`extauthz serve --workers N`); 1 when unset. */}}
{{- define "extauthz.workers" -}}
{{- .Values.server.workers | default 1 | int }}
{{- end }}

{{/*
Metrics ports as a JSON list of {name, port}: worker i listens on metrics.port + i
(extauthz/server/workers.py), so each worker gets its own named port.
*/}}
{{- define "extauthz.metricsPorts" -}}
{{- $ports := list }}
{{- range $i := until (include "extauthz.workers" . | int) }}
{{- $name := ternary "metrics" (printf "metrics-w%d" $i) (eq $i 0) }}
{{- $ports = append $ports (dict "name" $name "port" (add $.Values.metrics.port $i)) }}
{{- end }}
{{- toJson $ports }}
{{- end }}

{{/* Refuse combinations that cannot work. */}}
{{- define "extauthz.validate" -}}
{{- if not (include "extauthz.redisConfigured" .) }}
{{- if gt (int .Values.replicaCount) 1 }}
{{- fail "replicaCount > 1 needs a shared store: set redis.url or redis.existingSecret (the embedded store serves one replica)" }}
{{- end }}
{{- if gt (include "extauthz.workers" . | int) 1 }}
{{- fail "server.workers > 1 needs a shared store: set redis.url or redis.existingSecret (each worker process would enforce the whole limit)" }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- fail "autoscaling needs a shared store: set redis.url or redis.existingSecret (the embedded store serves one replica)" }}
{{- end }}
{{- end }}
{{- if and .Values.redis.url .Values.redis.existingSecret }}
{{- fail "set only one of redis.url and redis.existingSecret" }}
{{- end }}
{{- if and .Values.leaseSecret.value .Values.leaseSecret.existingSecret }}
{{- fail "set only one of leaseSecret.value and leaseSecret.existingSecret" }}
{{- end }}
{{- if and .Values.identitySalt.value .Values.identitySalt.existingSecret }}
{{- fail "set only one of identitySalt.value and identitySalt.existingSecret" }}
{{- end }}
{{- /* The server's stop budget after SIGTERM (extauthz/server/app.py stop_budget: the ports'
grace 5 s, all at once, the gRPC port's close linger 2 s, the release drain 5 s); the preStop
sleep runs before SIGTERM and inside the grace, and 2 s are left for the process's exit.
tests/helm/test_chart.py checks this number against the code. */}}
{{- $stopBudget := 12 }}
{{- $sleep := ternary 0 (int .Values.lifecycle.preStopSleepSeconds) (eq .Values.lifecycle.preStopMode "none") }}
{{- if lt (int .Values.terminationGracePeriodSeconds) (add $sleep $stopBudget 2) }}
{{- fail (printf "terminationGracePeriodSeconds %d is too short: at least lifecycle.preStopSleepSeconds (%d) + the server's stop budget (%d s) + 2 s, or Kubernetes kills the pod before in-flight calls finish and leases are released" (int .Values.terminationGracePeriodSeconds) $sleep $stopBudget) }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.serviceMonitor.enabled needs metrics.enabled" }}
{{- end }}
{{- if not (include "extauthz.policySources" . | fromJsonArray) }}
{{- fail "set policies (file name -> YAML), policies.configMaps or existingPolicyConfigMap" }}
{{- end }}
{{- if and .Values.tls.requireClientCertificate (not .Values.tls.existingSecret) }}
{{- fail "tls.requireClientCertificate needs tls.existingSecret (mTLS is TLS plus client certificates)" }}
{{- end }}
{{- $grpc := int .Values.server.grpcPort }}
{{- $metrics := int .Values.metrics.port }}
{{- if and .Values.tls.existingSecret (eq (int .Values.tls.healthPort) $grpc) }}
{{- fail "tls.healthPort must differ from server.grpcPort (the probes' plaintext port)" }}
{{- end }}
{{- if and .Values.tls.existingSecret .Values.metrics.enabled (le $metrics (int .Values.tls.healthPort)) (lt (int .Values.tls.healthPort) (add $metrics (include "extauthz.workers" . | int))) }}
{{- fail "tls.healthPort must lie outside the metrics ports (metrics.port .. metrics.port + workers - 1)" }}
{{- end }}
{{- if and .Values.metrics.enabled (le $metrics $grpc) (lt $grpc (add $metrics (include "extauthz.workers" . | int))) }}
{{- fail "server.grpcPort must lie outside the metrics ports (metrics.port .. metrics.port + workers - 1)" }}
{{- end }}
{{- with .Values.server.httpPort }}
{{- $http := int . }}
{{- if $.Values.tls.existingSecret }}
{{- fail "server.httpPort is plaintext: with tls on (outside a mesh) it would carry API keys in the clear; use the grpc port" }}
{{- end }}
{{- if eq $http $grpc }}
{{- fail "server.httpPort must differ from server.grpcPort" }}
{{- end }}
{{- if and $.Values.metrics.enabled (le $metrics $http) (lt $http (add $metrics (include "extauthz.workers" $ | int))) }}
{{- fail "server.httpPort must lie outside the metrics ports (metrics.port .. metrics.port + workers - 1)" }}
{{- end }}
{{- end }}
{{- end }}
