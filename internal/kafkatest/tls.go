package kafkatest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// PKI is a throwaway certificate authority for tests of TLS listeners: a CA, a server
// certificate and a client certificate it signed, and the same as PEM files in a temporary
// folder. Nothing is checked in; every test makes its own.
type PKI struct {
	// ServerName is the only name in the server certificate (no IP address), so a client
	// that dials 127.0.0.1 must set it to verify the broker.
	ServerName string
	// CAFile is the CA certificate, PEM.
	CAFile string
	// ClientCertFile and ClientKeyFile are a client certificate signed by the CA and its key.
	ClientCertFile, ClientKeyFile string
	// OtherCAFile is a CA that signed nothing here: trusting it alone must fail.
	OtherCAFile string

	ca     *x509.CertPool
	server tls.Certificate
}

// NewPKI creates a CA, a server certificate for serverName and a client certificate, valid
// for an hour, and writes them into t.TempDir().
func NewPKI(t testing.TB, serverName string) *PKI {
	t.Helper()
	dir := t.TempDir()
	p := &PKI{ServerName: serverName, ca: x509.NewCertPool()}
	caKey, caCert, caDER := newCA(t, "onceflow test CA")
	p.ca.AddCert(caCert)
	p.CAFile = writePEM(t, dir, "ca.pem", "CERTIFICATE", caDER)
	_, _, otherDER := newCA(t, "another CA")
	p.OtherCAFile = writePEM(t, dir, "other-ca.pem", "CERTIFICATE", otherDER)

	srvKey, srvDER := newLeaf(t, caKey, caCert, &x509.Certificate{
		Subject:     pkix.Name{CommonName: serverName},
		DNSNames:    []string{serverName},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	p.server = tls.Certificate{Certificate: [][]byte{srvDER}, PrivateKey: srvKey}

	cliKey, cliDER := newLeaf(t, caKey, caCert, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "onceflow-relay"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	p.ClientCertFile = writePEM(t, dir, "client.pem", "CERTIFICATE", cliDER)
	keyDER, err := x509.MarshalPKCS8PrivateKey(cliKey)
	if err != nil {
		t.Fatal(err)
	}
	p.ClientKeyFile = writePEM(t, dir, "client-key.pem", "PRIVATE KEY", keyDER)
	return p
}

// ServerConfig is the listener's TLS configuration (for kfake.TLS). With requireClientCert
// the listener refuses clients without a certificate signed by the CA (mutual TLS).
func (p *PKI) ServerConfig(requireClientCert bool) *tls.Config {
	cfg := &tls.Config{Certificates: []tls.Certificate{p.server}, MinVersion: tls.VersionTLS12}
	if requireClientCert {
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
		cfg.ClientCAs = p.ca
	}
	return cfg
}

// nextSerial is a random serial number, as RFC 5280 recommends: no two certificates share one.
func nextSerial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail
	}
	return n
}

func newCA(t testing.TB, name string) (*ecdsa.PrivateKey, *x509.Certificate, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          nextSerial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Minute),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return key, cert, der
}

func newLeaf(t testing.TB, caKey *ecdsa.PrivateKey, ca *x509.Certificate, tmpl *x509.Certificate) (*ecdsa.PrivateKey, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl.SerialNumber = nextSerial()
	tmpl.NotBefore = time.Now().Add(-time.Minute)
	tmpl.NotAfter = time.Now().Add(time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return key, der
}

func writePEM(t testing.TB, dir, name, typ string, der []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
