{{/*
Pod extras every pod the chart runs shares (the components and the optional vLLM server):
the values under <component> (or engine.vllm) named in helm/values_components.py PodExtras.
Each is called with (dict "root" $ "component" NAME "values" SECTION) and renders nothing
when the section leaves it empty.
*/}}

{{/* Pod-level fields: priorityClassName, topologySpreadConstraints, initContainers. A spread
constraint without a labelSelector gets the component's selector labels. */}}
{{- define "rtrl.pod.spec" -}}
{{- $c := .values }}
{{- $ctx := dict "root" .root "component" .component }}
{{- with $c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range . }}
  {{- $tsc := deepCopy . }}
  {{- if not (hasKey $tsc "labelSelector") }}
  {{- $_ := set $tsc "labelSelector" (dict "matchLabels" (include "rtrl.selectorLabels" $ctx | fromYaml)) }}
  {{- end }}
  - {{ toYaml $tsc | nindent 4 | trim }}
  {{- end }}
{{- end }}
{{- with $c.initContainers }}
initContainers:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The pod securityContext: (dict "defaults" DICT "values" SECTION), podSecurityContext over the defaults. */}}
{{- define "rtrl.pod.securityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy .defaults) (deepCopy (.values.podSecurityContext | default dict))) }}
{{- end }}

{{/* The main container's securityContext: (dict "defaults" DICT "values" SECTION). */}}
{{- define "rtrl.container.securityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy .defaults) (deepCopy (.values.securityContext | default dict))) }}
{{- end }}

{{/* The securityContext of rtrl's own containers, before a component's securityContext. */}}
{{- define "rtrl.container.defaultSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* A `helm test` pod that GETs each URL with files/tests/http_check.py in the rtrl image:
(dict "root" $ "name" SUFFIX "urls" LIST "apiKeys" BOOL). apiKeys gives it the gateway's
client keys for the /v1/ paths. */}}
{{- define "rtrl.testPod" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $ctx := dict "root" $root "component" "helm-test" }}
apiVersion: v1
kind: Pod
metadata:
  name: {{ printf "%s-test-%s" (include "rtrl.fullname" $root) .name | trunc 63 | trimSuffix "-" }}
  labels:
    {{- include "rtrl.componentLabels" $ctx | nindent 4 }}
  annotations:
    helm.sh/hook: test
    helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
spec:
  restartPolicy: Never
  serviceAccountName: {{ include "rtrl.serviceAccountName" $root }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ $v.securityContext.runAsUser }}
    runAsGroup: {{ $v.securityContext.runAsGroup }}
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: check
      image: {{ include "rtrl.image" $root | quote }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["python", "-c", {{ $root.Files.Get "files/tests/http_check.py" | quote }}]
      args:
        {{- range .urls }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: RTRL_TEST_TIMEOUT
          value: {{ $v.tests.timeoutSeconds | quote }}
        {{- if and .apiKeys (or $v.gateway.apiKeysSecret.name $v.gateway.apiKeys) }}
        {{- include "rtrl.secretEnv" (dict "root" $root "env" "RTRL_GATEWAY__API_KEYS" "ref" $v.gateway.apiKeysSecret "ownKey" "gateway-api-keys") | nindent 8 }}
        {{- end }}
      resources:
        requests:
          cpu: 10m
          memory: 32Mi
        limits:
          memory: 64Mi
      securityContext:
        {{- include "rtrl.container.defaultSecurityContext" . | nindent 8 }}
{{- end }}
