package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/onceflow/onceflow/relay/relaykafka"
)

// Where the SASL password comes from. It has no flag: a flag's value shows in ps and in shell
// history, so the password is read from a file (a mounted secret) or the environment.
const (
	envKafkaSASLPassword     = "ONCEFLOW_KAFKA_SASL_PASSWORD"
	envKafkaSASLPasswordFile = "ONCEFLOW_KAFKA_SASL_PASSWORD_FILE"
)

// maxPasswordFile bounds what is read from --kafka-sasl-password-file: a wrong path (a log,
// /dev/zero) must not fill the memory.
const maxPasswordFile = 64 << 10

// kafkaFlags are the flags that say how to reach Kafka — brokers, client id, TLS, SASL —
// shared by every command that talks to the cluster (relay, topics), so they are spelled
// and checked the same way everywhere.
type kafkaFlags struct {
	c            *cli
	brokers      string
	clientID     string
	tls          bool
	caFile       string
	certFile     string
	keyFile      string
	serverName   string
	mechanism    string
	user         string
	passwordFile string
	password     string // from ONCEFLOW_KAFKA_SASL_PASSWORD
}

// addKafkaFlags registers the Kafka connection flags; clientID is the command's default
// client id.
func (c *cli) addKafkaFlags(fs *flag.FlagSet, env *envParser, clientID string) *kafkaFlags {
	k := &kafkaFlags{c: c, password: c.getenv(envKafkaSASLPassword)}
	c.secrets.addLiteral(k.password)
	fs.StringVar(&k.brokers, "kafka-brokers", c.getenv("KAFKA_BROKERS"), "comma-separated Kafka brokers, host:port [KAFKA_BROKERS]")
	fs.StringVar(&k.clientID, "kafka-client-id", c.envOr("ONCEFLOW_KAFKA_CLIENT_ID", clientID), "client id the brokers see in their logs, quotas and ACL audit [ONCEFLOW_KAFKA_CLIENT_ID]")
	fs.BoolVar(&k.tls, "kafka-tls", env.bool("ONCEFLOW_KAFKA_TLS", false), "connect over TLS, with the system's root CAs unless --kafka-tls-ca-file is given; implied by every --kafka-tls-* flag [ONCEFLOW_KAFKA_TLS]")
	fs.StringVar(&k.caFile, "kafka-tls-ca-file", c.getenv("ONCEFLOW_KAFKA_TLS_CA_FILE"), "PEM `file` of the CA certificates that sign the brokers' certificates (default: the system's roots) [ONCEFLOW_KAFKA_TLS_CA_FILE]")
	fs.StringVar(&k.certFile, "kafka-tls-cert-file", c.getenv("ONCEFLOW_KAFKA_TLS_CERT_FILE"), "PEM `file` of the client certificate, for brokers that require one (mutual TLS); needs --kafka-tls-key-file [ONCEFLOW_KAFKA_TLS_CERT_FILE]")
	fs.StringVar(&k.keyFile, "kafka-tls-key-file", c.getenv("ONCEFLOW_KAFKA_TLS_KEY_FILE"), "PEM `file` of the client certificate's private key [ONCEFLOW_KAFKA_TLS_KEY_FILE]")
	fs.StringVar(&k.serverName, "kafka-tls-server-name", c.getenv("ONCEFLOW_KAFKA_TLS_SERVER_NAME"), "`name` the brokers' certificates must carry, when it is not the host in the broker address (brokers reached by IP, a tunnel) [ONCEFLOW_KAFKA_TLS_SERVER_NAME]")
	fs.StringVar(&k.mechanism, "kafka-sasl-mechanism", c.getenv("ONCEFLOW_KAFKA_SASL_MECHANISM"), "SASL `mechanism`: PLAIN (over TLS only), SCRAM-SHA-256 or SCRAM-SHA-512 (default: no SASL) [ONCEFLOW_KAFKA_SASL_MECHANISM]")
	fs.StringVar(&k.user, "kafka-sasl-user", c.getenv("ONCEFLOW_KAFKA_SASL_USER"), "SASL user name [ONCEFLOW_KAFKA_SASL_USER]")
	fs.StringVar(&k.passwordFile, "kafka-sasl-password-file", c.getenv(envKafkaSASLPasswordFile),
		"`file` holding the SASL password; a trailing newline is ignored. Or set the password itself in ["+envKafkaSASLPassword+"]; no flag takes it, as flag values show in ps ["+envKafkaSASLPasswordFile+"]")
	return k
}

// config returns the relaykafka settings the flags describe, with the problems found on the
// way (the password file). The rest is checked by relaykafka (NewSink, ClientOpts), which
// reports every problem at once.
func (k *kafkaFlags) config() (relaykafka.Config, []string) {
	var problems []string
	password := k.password
	if k.passwordFile != "" {
		if k.password != "" {
			problems = append(problems, fmt.Sprintf("the SASL password is given twice, in %s and in --kafka-sasl-password-file: keep one", envKafkaSASLPassword))
		}
		pw, err := readPasswordFile(k.passwordFile)
		if err != nil {
			problems = append(problems, err.Error())
		}
		k.c.secrets.addLiteral(pw)
		password = pw
	}
	return relaykafka.Config{
		Brokers:  splitList(k.brokers),
		ClientID: k.clientID,
		TLS: relaykafka.TLSConfig{
			Enabled: k.tls, CAFile: k.caFile, CertFile: k.certFile, KeyFile: k.keyFile, ServerName: k.serverName,
		},
		SASL: relaykafka.SASLConfig{Mechanism: k.mechanism, User: k.user, Password: password},
	}, problems
}

// readPasswordFile reads a password from a file as secret stores mount them: the whole file,
// without the trailing newline `echo` or an editor adds.
func readPasswordFile(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("--kafka-sasl-password-file: %w", err)
	}
	defer func() { _ = f.Close() }()
	b, err := io.ReadAll(io.LimitReader(f, maxPasswordFile+1))
	if err != nil {
		return "", fmt.Errorf("--kafka-sasl-password-file: %w", err)
	}
	if len(b) > maxPasswordFile {
		return "", fmt.Errorf("--kafka-sasl-password-file %s is larger than %d KiB: give the file that holds the password alone", path, maxPasswordFile>>10)
	}
	pw := strings.TrimRight(string(b), "\r\n")
	if pw == "" {
		return "", fmt.Errorf("--kafka-sasl-password-file %s is empty: write the SASL password into it", path)
	}
	return pw, nil
}

// plainWithoutTLS reports SASL PLAIN over a plaintext connection, which sends the password
// as it is: allowed (a private network may be trusted), but worth a warning.
func (k *kafkaFlags) plainWithoutTLS() bool {
	tlsOn := k.tls || k.caFile != "" || k.certFile != "" || k.keyFile != "" || k.serverName != ""
	return strings.EqualFold(k.mechanism, relaykafka.SASLPlain) && !tlsOn
}

// plainWithoutTLSWarning is what the commands say when plainWithoutTLS.
const plainWithoutTLSWarning = "SASL PLAIN without TLS sends the Kafka password unencrypted: turn TLS on (--kafka-tls) or use SCRAM-SHA-512"
