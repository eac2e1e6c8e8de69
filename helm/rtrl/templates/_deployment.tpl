{{/*
The Deployment every component shares. Call with
  (dict "root" $ "component" "ingest" "singleton" false)
A singleton (trainer, deployer) runs exactly one pod with the Recreate strategy, so two
controllers never act at once.
*/}}
{{- define "rtrl.deployment" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $c := index $v .component }}
{{- $ctx := dict "root" $root "component" .component }}
{{- $extras := dict "root" $root "component" .component "values" $c }}
{{- $kafkaTls := $v.kafka.tls }}
{{- $operatorKeys := and (eq .component "deployer") (include "rtrl.operatorKeys" $root) }}
{{- /* The gateway serves /metrics and the probes on its API port; the others on metrics.port. */}}
{{- $probePort := ternary "http" "metrics" (eq .component "gateway") }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "rtrl.componentName" $ctx }}
  labels:
    {{- include "rtrl.componentLabels" $ctx | nindent 4 }}
spec:
  {{- if .singleton }}
  replicas: 1
  strategy:
    type: Recreate
  {{- else }}
  {{- if not (and (hasKey $c "autoscaling") (or $c.autoscaling.enabled $c.keda.enabled)) }}
  replicas: {{ $c.replicas }}
  {{- end }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "rtrl.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "rtrl.componentLabels" $ctx | nindent 8 }}
        {{- with $c.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap-settings.yaml") $root | sha256sum }}
        checksum/secret: {{ include (print $root.Template.BasePath "/secret-credentials.yaml") $root | sha256sum }}
        {{- with $c.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "rtrl.serviceAccountName" $root }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ $c.terminationGracePeriodSeconds }}
      {{- with $c.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- with include "rtrl.pod.spec" $extras }}
      {{- . | trim | nindent 6 }}
      {{- end }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $podSecurity := dict "runAsNonRoot" true "runAsUser" $v.securityContext.runAsUser
            "runAsGroup" $v.securityContext.runAsGroup "fsGroup" $v.securityContext.fsGroup
            "seccompProfile" (dict "type" "RuntimeDefault") }}
      securityContext:
        {{- include "rtrl.pod.securityContext" (dict "defaults" $podSecurity "values" $c) | nindent 8 }}
      containers:
        - name: {{ .component }}
          image: {{ include "rtrl.image" $root | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          command: ["rtrl", "serve", {{ .component | quote }}]
          ports:
            {{- if eq .component "gateway" }}
            - name: http
              containerPort: {{ $c.port }}
              protocol: TCP
            {{- else }}
            - name: metrics
              containerPort: {{ $v.metrics.port }}
              protocol: TCP
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "rtrl.fullname" $root }}-settings
            {{- if $v.mlflow.envFromSecret }}
            - secretRef:
                name: {{ $v.mlflow.envFromSecret }}
            {{- end }}
          env:
            {{- include "rtrl.secretEnvs" $ctx | trim | nindent 12 }}
            {{- if eq .component "gateway" }}
            - name: RTRL_GATEWAY__HOST
              value: "0.0.0.0"
            - name: RTRL_GATEWAY__PORT
              value: {{ $c.port | quote }}
            {{- end }}
            {{- if eq .component "trainer" }}
            - name: RTRL_TRAINER__DATA_DIR
              value: /var/lib/rtrl/trainer
            {{- with include "rtrl.rayAddress" $root }}
            - name: RTRL_RAY__ADDRESS
              value: {{ . | quote }}
            {{- end }}
            - name: RTRL_RAY__NUM_WORKERS
              value: {{ $v.ray.numWorkers | quote }}
            - name: RTRL_RAY__CPUS_PER_WORKER
              value: {{ $v.ray.cpusPerWorker | quote }}
            - name: RTRL_RAY__USE_GPU
              value: {{ $v.ray.useGpu | quote }}
            {{- end }}
            {{- if $operatorKeys }}
            - name: RTRL_OPERATORS__KEYS_FILE
              value: /etc/rtrl/operators/keys
            {{- end }}
            {{- range $name, $value := $c.env }}
            - name: {{ $name }}
              value: {{ $value | quote }}
            {{- end }}
            {{- with $c.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          startupProbe:
            httpGet:
              path: /healthz
              port: {{ $probePort }}
            periodSeconds: 5
            failureThreshold: 60
          livenessProbe:
            httpGet:
              path: /healthz
              port: {{ $probePort }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 6
          readinessProbe:
            httpGet:
              path: /readyz
              port: {{ $probePort }}
            periodSeconds: 5
            timeoutSeconds: 5
            failureThreshold: 3
          resources:
            {{- include "rtrl.resources" $c.resources | trim | nindent 12 }}
          securityContext:
            {{- $containerSecurity := include "rtrl.container.defaultSecurityContext" . | fromYaml }}
            {{- include "rtrl.container.securityContext" (dict "defaults" $containerSecurity "values" $c) | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if eq .component "trainer" }}
            - name: dshm
              mountPath: /dev/shm
            - name: data
              mountPath: /var/lib/rtrl
            {{- end }}
            {{- if and (eq .component "deployer") (eq $v.engine.kind "vllm") }}
            - name: adapters
              mountPath: {{ $v.engine.adapters.deployerPath }}
            {{- end }}
            {{- if $kafkaTls.caSecret.name }}
            - name: kafka-ca
              mountPath: /etc/rtrl/kafka-ca
              readOnly: true
            {{- end }}
            {{- if $operatorKeys }}
            - name: operator-keys
              mountPath: /etc/rtrl/operators
              readOnly: true
            {{- end }}
            {{- if $kafkaTls.clientSecret.name }}
            - name: kafka-client
              mountPath: /etc/rtrl/kafka-client
              readOnly: true
            {{- end }}
            {{- with $c.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
        {{- with $c.sidecars }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $c.tmpSizeLimit }}
        {{- if eq .component "trainer" }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: 1Gi
        - name: data
          {{- if $c.persistence.enabled }}
          persistentVolumeClaim:
            claimName: {{ default (printf "%s-data" (include "rtrl.componentName" $ctx)) $c.persistence.existingClaim }}
          {{- else }}
          emptyDir: {}
          {{- end }}
        {{- end }}
        {{- if and (eq .component "deployer") (eq $v.engine.kind "vllm") }}
        - name: adapters
          persistentVolumeClaim:
            claimName: {{ include "rtrl.adapterClaim" $root }}
        {{- end }}
        {{- if $kafkaTls.caSecret.name }}
        - name: kafka-ca
          secret:
            secretName: {{ $kafkaTls.caSecret.name }}
            items:
              - key: {{ $kafkaTls.caSecret.key }}
                path: ca.crt
        {{- end }}
        {{- if $operatorKeys }}
        {{- $ref := $v.deployer.operators.existingSecret }}
        - name: operator-keys
          secret:
            secretName: {{ default (include "rtrl.secretName" $root) $ref.name }}
            defaultMode: 0400
            items:
              - key: {{ ternary $ref.key "operator-keys" (ne $ref.name "") }}
                path: keys
        {{- end }}
        {{- if $kafkaTls.clientSecret.name }}
        - name: kafka-client
          secret:
            secretName: {{ $kafkaTls.clientSecret.name }}
            items:
              - key: {{ $kafkaTls.clientSecret.certKey }}
                path: client.crt
              - key: {{ $kafkaTls.clientSecret.keyKey }}
                path: client.key
        {{- end }}
        {{- with $c.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $c.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/* requests/limits without the unset (null) entries */}}
{{- define "rtrl.resources" -}}
{{- range $kind := list "requests" "limits" }}
{{- $list := dict }}
{{- range $k, $q := (index $ $kind | default dict) }}
{{- if $q }}{{ $_ := set $list $k $q }}{{ end }}
{{- end }}
{{- if $list }}
{{ $kind }}:
  {{- toYaml $list | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}
