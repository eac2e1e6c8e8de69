{{/* Names and labels ---------------------------------------------------------------- */}}
{{- define "rtrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rtrl.fullname" -}}
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

{{/* "<fullname>-<component>"; call with (dict "root" $ "component" "gateway") */}}
{{- define "rtrl.componentName" -}}
{{- printf "%s-%s" (include "rtrl.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rtrl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "rtrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rtrl
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component; call with (dict "root" $ "component" "gateway") */}}
{{- define "rtrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rtrl.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "rtrl.componentLabels" -}}
{{ include "rtrl.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "rtrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rtrl.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* registry/repository:tag, or registry/repository@digest when a digest is set;
global.imageRegistry replaces image.registry. A repository that starts with its own
registry host (a first part with "." or ":", or localhost, as Docker reads it) is used as
it is, so repository: myregistry.example.com/rtrl keeps working. */}}
{{- define "rtrl.image" -}}
{{- $i := .Values.image }}
{{- $registry := default $i.registry .Values.global.imageRegistry }}
{{- $repo := $i.repository }}
{{- if and $registry (not (include "rtrl.hasRegistryHost" $repo)) }}
{{- $repo = printf "%s/%s" (trimSuffix "/" $registry) $repo }}
{{- end }}
{{- if $i.digest }}
{{- printf "%s@%s" $repo $i.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .Chart.AppVersion $i.tag) }}
{{- end }}
{{- end }}

{{/* "true" when an image reference starts with a registry host, else "". */}}
{{- define "rtrl.hasRegistryHost" -}}
{{- $parts := splitList "/" . }}
{{- $first := first $parts }}
{{- if and (gt (len $parts) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) }}true{{ end }}
{{- end }}

{{/* engine.vllm.image, behind global.imageRegistry when that is set and the image names no
registry of its own. */}}
{{- define "rtrl.vllmImage" -}}
{{- if and .Values.global.imageRegistry (not (include "rtrl.hasRegistryHost" .Values.engine.vllm.image)) }}
{{- printf "%s/%s" (trimSuffix "/" .Values.global.imageRegistry) .Values.engine.vllm.image }}
{{- else }}
{{- .Values.engine.vllm.image }}
{{- end }}
{{- end }}

{{- define "rtrl.secretName" -}}
{{- printf "%s-credentials" (include "rtrl.fullname" .) }}
{{- end }}

{{- define "rtrl.rayClusterName" -}}
{{- printf "%s-ray" (include "rtrl.fullname" .) | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/* The Ray address the trainer uses: the chart's RayCluster, else ray.address. */}}
{{- define "rtrl.rayAddress" -}}
{{- if .Values.ray.cluster.enabled }}
{{- printf "ray://%s-head-svc:10001" (include "rtrl.rayClusterName" .) }}
{{- else }}
{{- .Values.ray.address }}
{{- end }}
{{- end }}

{{/* Secrets ---------------------------------------------------------------------------- */}}
{{/* Which credentials the chart's own Secret holds (the rest come from existing Secrets). */}}
{{- define "rtrl.ownSecretKeys" -}}
{{- $keys := list }}
{{- if and .Values.kafka.sasl.password (not .Values.kafka.sasl.existingSecret.name) }}{{ $keys = append $keys "kafka-sasl-password" }}{{ end }}
{{- if and .Values.redis.url (not .Values.redis.existingSecret.name) }}{{ $keys = append $keys "redis-url" }}{{ end }}
{{- if and .Values.auth.keys (not .Values.auth.existingSecret.name) }}{{ $keys = append $keys "auth-keys" }}{{ end }}
{{- if and .Values.gateway.apiKeys (not .Values.gateway.apiKeysSecret.name) }}{{ $keys = append $keys "gateway-api-keys" }}{{ end }}
{{- if and .Values.engine.apiKey (not .Values.engine.existingSecret.name) }}{{ $keys = append $keys "engine-api-key" }}{{ end }}
{{- if and .Values.deployer.operators.keys (not .Values.deployer.operators.existingSecret.name) }}{{ $keys = append $keys "operator-keys" }}{{ end }}
{{- $n := .Values.deployer.notifications }}
{{- if and $n.urls (not $n.urlsSecret.name) }}{{ $keys = append $keys "notify-urls" }}{{ end }}
{{- if and $n.hmacKey (not $n.hmacKeySecret.name) }}{{ $keys = append $keys "notify-hmac-key" }}{{ end }}
{{- join "," $keys }}
{{- end }}

{{/* One env var from a Secret: (dict "root" $ "env" NAME "ref" existingSecretRef "ownKey" KEY) */}}
{{- define "rtrl.secretEnv" -}}
- name: {{ .env }}
  valueFrom:
    secretKeyRef:
      {{- if .ref.name }}
      name: {{ .ref.name }}
      key: {{ .ref.key }}
      {{- else }}
      name: {{ include "rtrl.secretName" .root }}
      key: {{ .ownKey }}
      {{- end }}
{{- end }}

{{/* Environment from Secrets for one component; call with (dict "root" $ "component" NAME) */}}
{{- define "rtrl.secretEnvs" -}}
{{- $v := .root.Values }}
{{- if or $v.kafka.sasl.existingSecret.name $v.kafka.sasl.password }}
{{ include "rtrl.secretEnv" (dict "root" .root "env" "RTRL_KAFKA__SASL_PASSWORD" "ref" $v.kafka.sasl.existingSecret "ownKey" "kafka-sasl-password") }}
{{- end }}
{{- if or $v.redis.existingSecret.name $v.redis.url }}
{{ include "rtrl.secretEnv" (dict "root" .root "env" "RTRL_REDIS__URL" "ref" $v.redis.existingSecret "ownKey" "redis-url") }}
{{- else }}
{{- fail "set redis.url or redis.existingSecret.name: every rtrl service needs Redis" }}
{{- end }}
{{- if and (has .component (list "gateway" "ingest")) (or $v.auth.existingSecret.name $v.auth.keys) }}
{{ include "rtrl.secretEnv" (dict "root" .root "env" "RTRL_AUTH__KEYS" "ref" $v.auth.existingSecret "ownKey" "auth-keys") }}
{{- end }}
{{- if and (eq .component "gateway") (or $v.gateway.apiKeysSecret.name $v.gateway.apiKeys) }}
{{ include "rtrl.secretEnv" (dict "root" .root "env" "RTRL_GATEWAY__API_KEYS" "ref" $v.gateway.apiKeysSecret "ownKey" "gateway-api-keys") }}
{{- end }}
{{- if and (has .component (list "gateway" "deployer")) (eq $v.engine.kind "vllm") (or $v.engine.existingSecret.name $v.engine.apiKey) }}
{{ include "rtrl.secretEnv" (dict "root" .root "env" "RTRL_ENGINE__API_KEY" "ref" $v.engine.existingSecret "ownKey" "engine-api-key") }}
{{- end }}
{{- $n := $v.deployer.notifications }}
{{- if and (eq .component "deployer") (include "rtrl.notifies" .root) }}
{{ include "rtrl.secretEnv" (dict "root" .root "env" "RTRL_NOTIFY__URLS" "ref" $n.urlsSecret "ownKey" "notify-urls") }}
{{- if or $n.hmacKey $n.hmacKeySecret.name }}
{{ include "rtrl.secretEnv" (dict "root" .root "env" "RTRL_NOTIFY__SECRET" "ref" $n.hmacKeySecret "ownKey" "notify-hmac-key") }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when the deployer has webhooks to notify (deployer.notifications), else "" */}}
{{- define "rtrl.notifies" -}}
{{- $n := .Values.deployer.notifications }}
{{- if or $n.urls $n.urlsSecret.name }}true{{ end }}
{{- end }}

{{/* "true" when the deployer has operator keys to mount (its own Secret's or an existing one). */}}
{{- define "rtrl.operatorKeys" -}}
{{- if or .Values.deployer.operators.keys .Values.deployer.operators.existingSecret.name }}true{{ end }}
{{- end }}

{{/* Engine ----------------------------------------------------------------------------- */}}
{{- define "rtrl.vllmName" -}}
{{- printf "%s-vllm" (include "rtrl.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The engine URL the gateway and deployer use: engine.baseUrl, else the chart's vLLM. */}}
{{- define "rtrl.engineUrl" -}}
{{- if .Values.engine.baseUrl }}
{{- .Values.engine.baseUrl }}
{{- else if .Values.engine.vllm.enabled }}
{{- printf "http://%s:%d" (include "rtrl.vllmName" .) (int .Values.engine.vllm.port) }}
{{- end }}
{{- end }}

{{- define "rtrl.adapterClaim" -}}
{{- if .Values.engine.adapters.claimName }}
{{- .Values.engine.adapters.claimName }}
{{- else if .Values.engine.adapters.create }}
{{- printf "%s-adapters" (include "rtrl.fullname" .) }}
{{- end }}
{{- end }}

{{/* Install-time checks: a release that would not start fails here, saying what to set. */}}
{{- define "rtrl.validate" -}}
{{- $v := .Values }}
{{- if $v.gateway.enabled }}
{{- if not (or $v.gateway.apiKeys $v.gateway.apiKeysSecret.name $v.gateway.allowAnonymous) }}
{{- fail "the gateway needs client API keys: set gateway.apiKeys.<key-id>=<key> (or gateway.apiKeysSecret.name), or gateway.allowAnonymous=true for development only" }}
{{- end }}
{{- if not (or (hasKey $v.auth.keys $v.gateway.signingKeyId) $v.auth.existingSecret.name $v.auth.allowUnsigned) }}
{{- fail (printf "the gateway signs the served events it sends with producer key %q: set auth.keys.%s=<secret> (or auth.existingSecret.name with that key id), or auth.allowUnsigned=true for development only" $v.gateway.signingKeyId $v.gateway.signingKeyId) }}
{{- end }}
{{- end }}
{{- if eq $v.engine.kind "vllm" }}
{{- if not (include "rtrl.engineUrl" .) }}
{{- fail "engine.kind=vllm needs an engine: set engine.baseUrl (an external engine) or engine.vllm.enabled=true" }}
{{- end }}
{{- if not (include "rtrl.adapterClaim" .) }}
{{- fail "engine.kind=vllm needs a volume that carries adapters from the deployer to the engine: set engine.adapters.claimName (an existing ReadWriteMany claim) or engine.adapters.create=true" }}
{{- end }}
{{- end }}
{{- if and $v.engine.vllm.enabled (not $v.engine.vllm.model) }}
{{- fail "engine.vllm.enabled needs engine.vllm.model: the base model's path (in engine.vllm.modelClaim, under /models) or hub name" }}
{{- end }}
{{- end }}
